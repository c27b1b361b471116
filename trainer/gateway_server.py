"""A worker's HTTP server for the API to proxy to: an agent run's gateway (trainer/rollout/agent_gateway.py)
and a training session's (trainer/primitives/commands.py). It listens on an ephemeral port of
``RLRUN_AGENT_GATEWAY_HOST`` (default 127.0.0.1), tells the API its address as
``RLRUN_AGENT_GATEWAY_ADVERTISE`` (default the listening host) and a per-run secret every request must
carry (``X-Rlrun-Gateway-Token``), which only the worker and the database hold."""

from __future__ import annotations

import hmac
import os
import secrets
import threading
from collections.abc import Callable
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN_HEADER = "X-Rlrun-Gateway-Token"
COMMAND_HEADER = "X-Rlrun-Command"  # a training session's call kind (trainer/primitives/commands.py)


def token_matches(headers: Message, token: str) -> bool:
    """Whether a request carries ``token`` (compared in constant time; any bytes may come in)."""
    given = (headers.get(TOKEN_HEADER) or "").encode("utf-8", "replace")
    return hmac.compare_digest(given, token.encode())


class GatewayServer:
    """A threaded HTTP server running until ``close``; ``handler_for(token)`` makes its request handler.
    ``address`` (``{url, token}``) is what the API needs to reach it."""

    def __init__(
        self,
        handler_for: Callable[[str], type[BaseHTTPRequestHandler]],
        name: str,
        host: str | None = None,
        advertise: str | None = None,
    ):
        self.token = secrets.token_urlsafe(32)
        host = host or os.environ.get("RLRUN_AGENT_GATEWAY_HOST", "127.0.0.1")
        self.server = ThreadingHTTPServer((host, 0), handler_for(self.token))
        self.server.daemon_threads = True
        shown = advertise or os.environ.get("RLRUN_AGENT_GATEWAY_ADVERTISE") or host
        self.url = f"http://{shown}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name=name, daemon=True)
        self.thread.start()

    @property
    def address(self) -> dict[str, str]:
        return {"url": self.url, "token": self.token}

    def close(self) -> None:
        """Stop listening; idempotent."""
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
