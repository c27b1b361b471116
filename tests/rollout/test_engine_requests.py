"""A generation cancelled while the engine works leaves no thread that holds up the process's exit
(trainer/rollout/served_engine.py, ``in_daemon_thread``). Against a stand-in engine that answers the abort
but never the generation it aborted (as vLLM's server leaves an aborted request's connection waiting)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from trainer.phases import RunStopped
from trainer.rollout.base import SamplingParams
from trainer.rollout.served_engine import ServedEngine
from trainer.stop_watch import raise_in_thread


class Engine(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/v1/completions":
            time.sleep(3600)  # aborted: never answered
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
server.daemon_threads = True
threading.Thread(target=server.serve_forever, daemon=True).start()
engine = ServedEngine(f"http://127.0.0.1:{server.server_port}", max_model_len=64)
main = threading.get_ident()
threading.Timer(0.5, lambda: raise_in_thread(main, RunStopped)).start()  # the run's stop watch
try:
    engine.generate([[1, 2, 3]], 1, SamplingParams(max_new_tokens=4, greedy=True))
except RunStopped:
    print("cancelled", flush=True)
engine.close()
"""


def test_a_process_that_cancelled_a_generation_exits_at_once() -> None:
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,  # the request's own timeout is 600 s: a joined request thread would hold it that long
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "cancelled"
    assert time.monotonic() - began < 30
