"""GZip for JSON answers only (a metrics page of a long run is ~470 KB of JSON, ~8x smaller compressed).

Starlette's GZipMiddleware compresses every type it does not exclude, streams included, where a chunk can
wait in the compressor: token streams from the inference routes would stall, and downloads (tar, files)
would lose their Content-Length. This compresses a response only when it is ``application/json``, sent in
one body (not streamed), at least ``minimum_size`` bytes, and the client accepts gzip. Everything else
passes through untouched.
"""

from __future__ import annotations

import gzip

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MINIMUM_SIZE = 1000  # bytes: below this the gzip header and CPU cost more than they save


class JsonGzipMiddleware:
    def __init__(self, app: ASGIApp, minimum_size: int = MINIMUM_SIZE, compresslevel: int = 5) -> None:
        self.app, self.minimum_size, self.compresslevel = app, minimum_size, compresslevel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or "gzip" not in Headers(scope=scope).get("accept-encoding", ""):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        passing = False

        async def send_maybe_compressed(message: Message) -> None:
            nonlocal start, passing
            if passing:
                await send(message)
                return
            if message["type"] == "http.response.start":
                headers = Headers(raw=message.get("headers", []))
                media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
                if media_type != "application/json" or "content-encoding" in headers:
                    passing = True
                    await send(message)
                else:
                    start = message  # held until the body shows whether it is one piece
                return
            assert start is not None
            passing = True
            body = message.get("body", b"")
            if message["type"] != "http.response.body" or message.get("more_body", False):
                await send(start)  # streamed: sent as it comes
                await send(message)
                return
            headers = MutableHeaders(raw=start["headers"])
            headers.add_vary_header("Accept-Encoding")
            if len(body) >= self.minimum_size:
                body = gzip.compress(body, compresslevel=self.compresslevel, mtime=0)
                headers["Content-Encoding"] = "gzip"
                headers["Content-Length"] = str(len(body))
            await send(start)
            await send({**message, "body": body})

        await self.app(scope, receive, send_maybe_compressed)
