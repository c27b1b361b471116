"""A training session's calls as the worker sees them (issue 40): the API submits each ``forward_backward``
or ``optim_step`` to the worker's session gateway (an HTTP server in the training process, as the agent
gateway is: trainer/rollout/agent_gateway.py), the loop's thread executes them one at a time in the order
they came (the SDK sends call N+1 only once N's submit has returned, so arrival order is its ``seq_id``
order), and the API polls each call's result, which waits here until it is ready.

    POST /commands   X-Rlrun-Command: forward_backward | optim_step | save_sampler | sample | save_state
                     | finish
                     -> 200 {"request_id"} | 400 {"detail", "field"} (refused before it is queued)
    GET  /futures/{id}?wait=S
                     -> 200 the result (protobuf for forward_backward and sample, else JSON), or
                        {"error", "category": "user"} | 200 {"type": "try_again"} after S seconds | 404
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from trainer.gateway_server import COMMAND_HEADER, GatewayServer, token_matches
from trainer.primitives.wire import WireError

log = logging.getLogger("rlrun.worker")
KINDS = ("forward_backward", "optim_step", "save_sampler", "sample", "save_state", "finish")
MAX_BODY = 256 * 1024 * 1024
MAX_WAIT = 40.0
KEPT_RESULTS = 256  # results kept after they are read (a client may poll one again)


@dataclass
class Command:
    id: int
    kind: str
    payload: Any  # what ``check`` made of the body
    done: threading.Event = field(default_factory=threading.Event)
    result: bytes | None = None
    content_type: str = "application/json"


# kind, raw body -> what the loop will execute (raises WireError: the call is refused at once)
Check = Callable[[str, bytes], Any]


class CommandQueue:
    """Calls in arrival order for the loop's thread, and their results for the HTTP threads."""

    def __init__(self, check: Check):
        self.check = check
        self.cond = threading.Condition()
        self.pending: deque[Command] = deque()
        self.results: OrderedDict[int, Command] = OrderedDict()
        self.next_id = 1
        self.last_call = time.monotonic()
        self.closed = False

    def submit(self, kind: str, raw: bytes) -> int:
        """Queue a call (checked first); its id."""
        payload = self.check(kind, raw)
        with self.cond:
            if self.closed:
                raise WireError("the session is over", "model_id")
            command = Command(self.next_id, kind, payload)
            self.next_id += 1
            self.pending.append(command)
            self.results[command.id] = command
            self.last_call = time.monotonic()
            self.cond.notify_all()
            return command.id

    def take(self, wait: float) -> Command | None:
        """The next call to execute, waiting up to ``wait`` seconds (None: none came)."""
        with self.cond:
            self.cond.wait_for(lambda: bool(self.pending), timeout=wait)
            return self.pending.popleft() if self.pending else None

    def finish(self, command: Command, result: bytes, content_type: str = "application/json") -> None:
        with self.cond:
            command.result, command.content_type = result, content_type
            self.last_call = time.monotonic()
            done = [k for k, c in self.results.items() if c.result is not None]
            for k in done[: max(0, len(done) - KEPT_RESULTS)]:
                del self.results[k]
        command.done.set()

    def fail(self, command: Command, why: str) -> None:
        self.finish(command, json.dumps({"error": why, "category": "user"}).encode())

    def result(self, command_id: int, wait: float) -> Command | None:
        """The call, once done (waiting up to ``wait`` s); None: not done yet.

        Raises:
            KeyError: no such call (or its result is long gone).
        """
        with self.cond:
            command = self.results[command_id]
        command.done.wait(wait)
        return command if command.done.is_set() else None

    def idle_for(self) -> float:
        with self.cond:
            return 0.0 if self.pending else time.monotonic() - self.last_call

    def close(self, why: str) -> None:
        """No more calls; the ones not executed fail with ``why``."""
        with self.cond:
            self.closed = True
            left, self.pending = list(self.pending), deque()
        for c in left:
            self.fail(c, why)


class SessionGateway(GatewayServer):
    """``queue`` on HTTP (module docstring) until ``close``; ``address`` is what the API needs."""

    def __init__(self, queue: CommandQueue, host: str | None = None, advertise: str | None = None):
        self.queue = queue
        super().__init__(lambda token: _handler(queue, token), "session-gateway", host, advertise)


def _handler(queue: CommandQueue, token: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, body: dict[str, Any]) -> None:
            self._send(status, json.dumps(body).encode())

        def _allowed(self) -> bool:
            if token_matches(self.headers, token):
                return True
            self._json(401, {"detail": "a gateway token is needed"})
            return False

        def do_POST(self) -> None:  # noqa: N802 - the base class's name
            if not self._allowed():
                return
            kind = self.headers.get(COMMAND_HEADER, "")
            length = int(self.headers.get("Content-Length") or 0)
            if urlsplit(self.path).path != "/commands" or kind not in KINDS:
                self._json(404, {"detail": f"no command {kind!r} at {self.path}"})
                return
            if length > MAX_BODY:
                self._json(413, {"detail": f"the body is over {MAX_BODY} bytes"})
                return
            raw = self.rfile.read(length)
            try:
                self._json(200, {"request_id": str(queue.submit(kind, raw))})
            except WireError as exc:
                self._json(400, {"detail": str(exc), "field": exc.field})
            except Exception as exc:  # noqa: BLE001 - an answer, never a dropped connection
                log.exception("session gateway: %s failed", kind)
                self._json(500, {"detail": f"internal error: {type(exc).__name__}"})

        def do_GET(self) -> None:  # noqa: N802 - the base class's name
            if not self._allowed():
                return
            url = urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            if len(parts) != 2 or parts[0] != "futures" or not parts[1].isdigit():
                self._json(404, {"detail": f"no route {url.path}"})
                return
            try:
                wait = min(max(float(parse_qs(url.query).get("wait", ["0"])[0]), 0.0), MAX_WAIT)
                command = queue.result(int(parts[1]), wait)
            except ValueError:
                self._json(400, {"detail": "wait must be a number of seconds"})
                return
            except KeyError:
                self._json(404, {"detail": f"no request {parts[1]} in this session"})
                return
            if command is None or command.result is None:
                self._json(200, {"type": "try_again", "request_id": parts[1], "queue_state": "active"})
            else:
                self._send(200, command.result, command.content_type)

    return Handler
