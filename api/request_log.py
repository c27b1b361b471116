"""ASGI middleware: one log line per HTTP request (method, path, status, milliseconds to the response's
start), as ``rlrun.api`` INFO.

Plain ASGI rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` runs the app in a
task group and relays the response through a memory stream. Replacing it (and running the dependencies
that only read ``app.state`` on the event loop, api/deps.py) took a refused ``POST /v1/runs`` from 1.74 to
1.04 ms in process and ``GET /v1/runs`` from 2.29 to 1.89 ms (``bench/api_requests.py``, 2-core machine)."""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("rlrun.api")


class RequestLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()

        async def logging_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                ms = (time.perf_counter() - start) * 1000
                log.info("%s %s %d %.1fms", scope["method"], scope["path"], message["status"], ms)
            await send(message)

        await self.app(scope, receive, logging_send)
