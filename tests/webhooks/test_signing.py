"""Standard Webhooks signatures: the spec's published example, and the reference verifier."""

from __future__ import annotations

import json
import time

import pytest
from standardwebhooks import Webhook as ReferenceVerifier
from standardwebhooks.webhooks import WebhookVerificationError

from api.webhook_signing import new_secret, sign, signed_headers


def test_the_published_example_signature() -> None:
    # The example in the Standard Webhooks / Svix documentation ("Verifying webhooks manually").
    signature = sign(
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "msg_p5jXN8AQM9LWM0D4loKWxJek",
        1614265330,
        '{"test": 2432232314}',
    )
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_the_reference_library_verifies_our_headers_and_rejects_tampering() -> None:
    secret = new_secret()
    body = json.dumps({"type": "run.succeeded", "data": {"id": "r1", "status": "succeeded"}})
    headers = signed_headers(secret, "msg_abc", int(time.time()), body)
    assert ReferenceVerifier(secret).verify(body, headers) == json.loads(body)
    with pytest.raises(WebhookVerificationError):
        ReferenceVerifier(secret).verify(body.replace("succeeded", "failed"), headers)
    with pytest.raises(WebhookVerificationError):
        ReferenceVerifier(new_secret()).verify(body, headers)
    stale = signed_headers(secret, "msg_abc", int(time.time()) - 3600, body)
    with pytest.raises(WebhookVerificationError):  # receivers refuse replays older than 5 minutes
        ReferenceVerifier(secret).verify(body, stale)


def test_secrets_are_fresh_32_byte_keys() -> None:
    import base64

    a, b = new_secret(), new_secret()
    assert a != b and a.startswith("whsec_")
    assert len(base64.b64decode(a.removeprefix("whsec_"))) == 32
