"""Ctrl+C on `rlrun serve` in a terminal: the signal reaches its whole process group, the worker included,
which stops on it (Celery exits 1 on SIGINT). `rlrun serve` keeps its worker (rlrun/kept_process.py), but
not while it shuts down itself: no other worker is started while the API's graceful shutdown waits for a
request in flight."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlrun.demo import wait_healthy
from tests.integration.flow import serve_workers, upload_pairs
from trainer.ports import free_port

pytestmark = [pytest.mark.slow]


def wait_until(done: object, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def start_serve(home: Path, **popen: Any) -> tuple[subprocess.Popen[bytes], int, Path]:
    """`rlrun serve --no-inference` on the embedded defaults in ``home``, in a process group of its own (as
    a terminal gives it), its output in ``home/serve.log``: the process, its port and the log."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RLRUN_DATABASE_URL", "RLRUN_BROKER_URL")}
    env |= {"RLRUN_HOME": str(home), "RLRUN_PORT": str(port)}
    log = home / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlrun.cli", "serve", "--no-inference"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **popen,
        )
    return proc, port, log


@pytest.mark.parametrize(
    "inherited",
    [signal.SIG_DFL, signal.SIG_IGN],
    ids=["terminal", "sigint-ignored-at-start"],  # SIG_IGN: a background job of a shell without job control
)
def test_ctrl_c_stops_serve_and_its_worker_and_starts_no_other(
    tmp_path: Path, inherited: signal.Handlers
) -> None:
    """Where serve started with SIGINT ignored (as the suite's own processes do when `make test` runs in
    the background of a script), uvicorn's re-raise of the Ctrl+C does nothing; serve still ends with
    130 (it ended with 0 before serve noted the signal itself)."""
    proc, port, log = start_serve(tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, inherited))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            wait_healthy(client, proc)
            wait_until(lambda: " ready." in log.read_text(), "the worker never got ready")
            (worker,) = serve_workers(tmp_path)
            spec = {
                "algorithm": "dpo",
                "model": "tiny:llama-0.4m",
                "dataset_id": upload_pairs(client, n=40)["id"],
            }
            body = json.dumps(spec).encode()

            def trickle() -> Iterator[bytes]:  # a request in flight for 6 s: the API waits for it to end
                for i in range(0, len(body), len(body) // 12 + 1):
                    yield body[i : i + len(body) // 12 + 1]
                    time.sleep(0.5)

            answers: list[int] = []
            headers = {"content-type": "application/json"}
            slow = threading.Thread(
                target=lambda: answers.append(
                    client.post("/v1/runs", content=trickle(), headers=headers).status_code
                )
            )
            slow.start()
            time.sleep(1)
            os.killpg(proc.pid, signal.SIGINT)
            wait_until(lambda: not Path(f"/proc/{worker}/cmdline").exists(), "the worker outlived Ctrl+C")
            time.sleep(2)  # past the first restart's delay (1 s), while the API still serves the slow request
            assert proc.poll() is None and serve_workers(tmp_path) == []
            slow.join(timeout=60)
            assert answers == [201]  # the request in flight was answered before the API stopped
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert "starting another" not in text and "Traceback" not in text, text[-3000:]
    assert proc.returncode == 128 + signal.SIGINT  # as a shell reports a command ended by Ctrl+C


def test_a_serve_killed_with_sigkill_takes_its_worker_with_it(tmp_path: Path) -> None:
    """SIGKILL gives `rlrun serve` no chance to stop its worker; the kernel does (PR_SET_PDEATHSIG, set
    between fork and exec from a libc opened in the parent: rlrun/server_commands.py), so no worker is left
    orphaned to take runs for a server that is gone."""
    proc, port, _ = start_serve(tmp_path)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            wait_healthy(client, proc)
        wait_until(lambda: len(serve_workers(tmp_path)) == 1, "serve started no worker")
        (worker,) = serve_workers(tmp_path)
        proc.kill()  # serve alone, not its process group
        proc.wait(timeout=10)
        wait_until(lambda: not Path(f"/proc/{worker}/cmdline").exists(), "the worker outlived serve", 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
