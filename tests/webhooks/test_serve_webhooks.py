"""Webhooks end to end: `rlrun serve` (API, worker, dispatcher) trains a run and calls a receiver on
loopback, which fails the first delivery; the retry succeeds and the delivery log shows both."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from standardwebhooks import Webhook as ReferenceVerifier

from tests.integration.flow import embedded_server, submit_dpo, upload_pairs, wait_for
from tests.webhooks.receiver import webhook_receiver

pytestmark = [pytest.mark.slow]


def test_run_end_is_delivered_signed_and_retried(tmp_path: Path) -> None:
    env = {
        "RLRUN_WEBHOOK_ALLOW_LOOPBACK": "true",
        "RLRUN_WEBHOOK_POLL_SECONDS": "0.2",
        "RLRUN_WEBHOOK_BACKOFF_SECONDS": "0.5",
    }
    with webhook_receiver(statuses=[500]) as receiver, embedded_server(tmp_path, env=env) as client:
        hook = client.post("/v1/webhooks", json={"url": receiver.url}).json()
        dataset = upload_pairs(client, n=40)
        run = submit_dpo(client, dataset["id"], steps=4)
        wait_for(client, run["id"], lambda r: r["status"] == "succeeded")
        deadline = time.monotonic() + 30
        while True:
            log = client.get(f"/v1/webhooks/{hook['id']}/deliveries").json()["data"]
            if log and log[0]["status"] != "pending":
                break
            assert time.monotonic() < deadline, log
            time.sleep(0.2)
        (delivery,) = log
        assert delivery["status"] == "succeeded" and delivery["run_id"] == run["id"]
        assert [a["status_code"] for a in delivery["attempts"]] == [500, 200]
        assert delivery["payload"]["data"]["status"] == "succeeded"
        assert len(receiver.requests) == 2
        final = receiver.requests[-1]
        payload = ReferenceVerifier(hook["secret"]).verify(final.body, final.headers)
        assert payload["type"] == "run.succeeded" and payload["data"]["id"] == run["id"]
        assert payload["data"]["progress"]["step"] == 4
        assert final.headers["webhook-id"] == delivery["message_id"]
        # Refused without the loopback setting's say-so is covered in test_api; here the server
        # refuses an internal address even with loopback allowed.
        resp = client.post("/v1/webhooks", json={"url": "http://169.254.169.254/latest/meta-data"})
        assert resp.status_code == 422 and resp.json()["error"]["field"] == "url"
