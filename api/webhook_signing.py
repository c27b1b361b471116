"""Webhook signatures, the Standard Webhooks scheme (https://www.standardwebhooks.com, spec v1).

A message carries three headers: ``webhook-id`` (the same on every retry, so receivers can deduplicate),
``webhook-timestamp`` (unix seconds of this attempt) and ``webhook-signature``::

    webhook-signature = "v1," + base64( HMAC-SHA256( key, f"{webhook-id}.{webhook-timestamp}.{body}" ) )

where ``key`` is the base64-decoded part of the endpoint's secret ``whsec_<base64>``. Receivers verify
with any Standard Webhooks library (``standardwebhooks.Webhook(secret).verify(body, headers)``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

SECRET_PREFIX = "whsec_"


def new_secret() -> str:
    """A fresh signing secret: 32 random bytes, ``whsec_<base64>``."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def sign(secret: str, message_id: str, timestamp: int, body: str) -> str:
    """The ``webhook-signature`` value (``v1,<base64 HMAC-SHA256>``) of one attempt."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    content = f"{message_id}.{timestamp}.{body}".encode()
    return "v1," + base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode()


def signed_headers(secret: str, message_id: str, timestamp: int, body: str) -> dict[str, str]:
    """All headers of one delivery attempt."""
    return {
        "content-type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, message_id, timestamp, body),
    }
