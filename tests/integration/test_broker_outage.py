"""Broker outage drill: a run submitted while Redis is down starts within 15 s of Redis coming back, with
the default reconcile period and re-send interval (issue 12, item 9). Reuses the fault drills' Stack:
PostgreSQL, a private redis-server on a spare loopback port, `rlrun serve --no-worker` and one worker."""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.flow import wait_for
from tests.integration.test_fault_drills import Proc, open_stack, submit, upload

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server binary not installed"),
]


def wait_until(what: str, ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


def worker_ready(worker: Proc) -> bool:
    return worker.log_path.exists() and " ready." in worker.log_path.read_text(errors="replace")


def test_drill_run_submitted_while_redis_is_down_starts_within_15s_of_its_return(tmp_path: Path) -> None:
    # The defaults (a pass every 10 s, a re-send after 300 s), not the drills' short periods: the point.
    with open_stack(tmp_path, RLRUN_RECONCILE_SECONDS="10", RLRUN_RESEND_AFTER_SECONDS="300") as stack:
        worker = stack.start_worker()
        dataset_id = upload(stack.client, 16)
        wait_until("the worker", lambda: worker_ready(worker), timeout=90)
        stack.redis.kill9()  # no persistence: whatever it held is gone too
        run_id = submit(stack.client, dataset_id, max_steps=1)  # 201 even so
        events = stack.client.get(f"/v1/runs/{run_id}/events").json()["data"]
        assert any(e["kind"] == "warning" and "broker" in e["message"] for e in events), events
        stack.redis.start()
        wait_until("redis", lambda: accepts(stack.redis_port), timeout=10)
        back = time.monotonic()
        run = wait_for(stack.client, run_id, lambda r: r["status"] != "queued", timeout=15)
        waited = time.monotonic() - back
        assert run["status"] in ("running", "succeeded"), run
        assert waited <= 15, f"claimed {waited:.1f} s after Redis came back"
        print(f"claimed {waited:.1f} s after Redis came back")
