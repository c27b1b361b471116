"""Opaque cursors: a JSON list of the last row's sort key, base64url-encoded."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from api.errors import InvalidRequest


def encode_cursor(*key: Any) -> str:
    raw = json.dumps([str(k) if not isinstance(k, int | float) else k for k in key]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, arity: int) -> list[Any]:
    """The sort key in ``cursor``; a cursor this API did not make is refused naming ``after``."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        key = json.loads(raw)
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise InvalidRequest("after: not a cursor returned by this API", field="after") from None
    if not isinstance(key, list) or len(key) != arity:
        raise InvalidRequest("after: not a cursor returned by this API", field="after")
    return key
