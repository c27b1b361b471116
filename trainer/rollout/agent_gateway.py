"""The worker's HTTP face of an agent run's ``AgentBoard`` (trainer/rollout/agent_episodes.py): a small
threaded server on an ephemeral port that the API proxies (api/routers/agent.py), so agents talk to the
service's address with their API key and never to a worker directly.

    GET  /episodes/next?wait=S               200 {id, row, evaluation} | 204 none yet | 410 the run is over
    POST /episodes/{id}/chat/completions     OpenAI's chat completion (token ids added) | 4xx {"error": ...}
    POST /episodes/{id}/reward               {"reward": float} -> 200 | 4xx {"error": ...}

Every request carries the run's gateway token (``X-Rlrun-Gateway-Token``), which only the worker and the
database hold. The address is ``RLRUN_AGENT_GATEWAY_HOST`` (where it listens, default 127.0.0.1) and
``RLRUN_AGENT_GATEWAY_ADVERTISE`` (the host the API reaches it at, default the listening host; set both
where the API runs on another machine).
"""

from __future__ import annotations

import json
import logging
import re
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from trainer.gateway_server import GatewayServer, token_matches
from trainer.rollout.agent_chat import AgentRequestError
from trainer.rollout.agent_episodes import AgentBoard, BoardClosed

log = logging.getLogger("rlrun.worker")
MAX_BODY = 16 * 1024 * 1024  # a chat completion request's JSON, at most
MAX_WAIT = 60.0  # seconds a ``next`` long poll may wait
_EPISODE = re.compile(r"^/episodes/([0-9a-f]{32})/(chat/completions|reward)$")


def error_body(message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, which its SDK reads into its exceptions."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


class AgentGateway(GatewayServer):
    """Serves ``board`` on HTTP until ``close``; ``address`` is what the API needs to reach it."""

    def __init__(self, board: AgentBoard, host: str | None = None, advertise: str | None = None):
        self.board = board
        super().__init__(lambda token: _handler(board, token), "agent-gateway", host, advertise)

    def close(self) -> None:
        """Refuse what is waiting (the board closes), stop listening; idempotent."""
        self.board.close()
        super().close()


def _handler(board: AgentBoard, token: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # the API logs the requests it proxies

        def _send(self, status: int, body: dict[str, Any] | None = None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _allowed(self) -> bool:
            if token_matches(self.headers, token):
                return True
            self._send(401, error_body("a gateway token is needed", code="unauthorized"))
            return False

        def do_GET(self) -> None:  # noqa: N802 - the base class's name
            if not self._allowed():
                return
            url = urlsplit(self.path)
            if url.path != "/episodes/next":
                self._send(404, error_body(f"no route {url.path}"))
                return
            try:
                wait = min(max(float(parse_qs(url.query).get("wait", ["0"])[0]), 0.0), MAX_WAIT)
                offer = board.next_episode(wait)
            except ValueError:
                self._send(400, error_body("wait must be a number of seconds", param="wait"))
                return
            except BoardClosed as exc:
                self._send(410, error_body(str(exc), code="run_over"))
                return
            if offer is None:
                self._send(204)
            else:
                self._send(200, offer)

        def do_POST(self) -> None:  # noqa: N802 - the base class's name
            if not self._allowed():
                return
            match = _EPISODE.match(urlsplit(self.path).path)
            length = int(self.headers.get("Content-Length") or 0)
            if match is None:
                self._send(404, error_body(f"no route {self.path}"))
                return
            if length > MAX_BODY:
                self._send(413, error_body(f"the body is over {MAX_BODY} bytes"))
                return
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except ValueError:
                self._send(400, error_body("the body is not JSON"))
                return
            episode, what = match.groups()
            try:
                if what == "reward":
                    board.report(episode, body.get("reward") if isinstance(body, dict) else None)
                    self._send(200, {"id": episode, "reward": body["reward"]})
                else:
                    self._send(200, board.chat(episode, body))
            except AgentRequestError as exc:
                self._send(exc.status, error_body(str(exc), exc.param, exc.code))
            except Exception as exc:  # noqa: BLE001 - an answer, never a dropped connection (the proxy's 503)
                log.exception("agent gateway: %s failed", self.path)
                self._send(500, error_body(f"internal error: {type(exc).__name__}", code="internal_error"))

    return Handler
