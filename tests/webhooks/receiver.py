"""A webhook receiver on loopback for tests: records every request, answers with scripted statuses."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: str


@dataclass
class Receiver:
    url: str
    statuses: list[int] = field(default_factory=list)  # answers in order; 200 once used up
    barrier: threading.Barrier | None = None  # if set, each request waits there first (500 if broken)
    requests: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_status(self) -> int:
        with self.lock:
            return self.statuses.pop(0) if self.statuses else 200


@contextmanager
def webhook_receiver(
    statuses: list[int] | None = None, host: str = "127.0.0.1", barrier: threading.Barrier | None = None
) -> Iterator[Receiver]:
    state = Receiver(url="", statuses=list(statuses or []), barrier=barrier)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            length = int(self.headers.get("content-length", "0"))
            body = self.rfile.read(length).decode()
            headers = {k.lower(): v for k, v in self.headers.items()}
            with state.lock:
                state.requests.append(Received(self.path, headers, body))
            status = state.next_status()
            if state.barrier is not None:
                try:
                    state.barrier.wait()
                except threading.BrokenBarrierError:
                    status = 500
            self.send_response(status)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, 0), Handler)
    state.url = f"http://{host}:{server.server_address[1]}/hooks/rlrun"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
