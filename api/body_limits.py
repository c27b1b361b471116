"""Request bodies bounded as they stream (uploads to /v1/datasets and /v1/files)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import Message

from api.errors import PayloadTooLarge

# Room for the multipart framing around the file (boundaries, part headers, the other form fields).
FRAMING_BYTES = 64 * 1024


def limit_body(request: Request, max_bytes: int) -> Request:
    """The same request with a body that may not exceed ``max_bytes`` (plus ``FRAMING_BYTES``): 413 at once
    when Content-Length says so, else as the bytes arrive. A chunked body has no length to check up front;
    counting the ASGI messages before the form parser sees them means it never spools more than the limit,
    and the client's remaining bytes are never read into memory."""
    limit = max_bytes + FRAMING_BYTES

    def too_large() -> PayloadTooLarge:
        return PayloadTooLarge(f"upload is larger than the limit of {max_bytes} bytes", field="file")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large()
    receive = request.receive
    received = 0

    async def counted() -> Message:
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise too_large()
        return message

    return Request(request.scope, counted)
