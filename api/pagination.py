"""Opaque cursors: a JSON list of the last row's sort key, base64url-encoded."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any

from fastapi import Query

from api.errors import InvalidRequest

# A cursor is never empty: the schema says so, so an empty `after=` is refused by the schema too.
AfterCursor = Annotated[
    str | None, Query(min_length=1, description="`next_cursor` of the previous page (omit for the first).")
]


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
    # Ids and steps are 32-bit columns: a forged larger number would fail in the database, not here.
    if any(isinstance(v, int) and not -(2**31) <= v < 2**31 for v in key):
        raise InvalidRequest("after: not a cursor returned by this API", field="after")
    return key
