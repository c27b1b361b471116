"""`rlrun serve` on the embedded defaults (SQLite + kombu SQL broker): no server needed.

Trains the demo's run (200 addition pairs, 300 steps) to the accuracy the README promises, and cancels a
long run end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from api.demo import free_port, wait_healthy
from tests.integration.flow import FINISHED, all_metrics, submit_dpo, upload_pairs, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    home = tmp_path_factory.mktemp("embedded")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RLRUN_DATABASE_URL", "RLRUN_BROKER_URL")}
    env |= {"RLRUN_HOME": str(home), "RLRUN_PORT": str(port)}
    log = (home / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "serve"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            wait_healthy(client, proc)
            yield client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        print((home / "serve.log").read_text()[-3000:])
    assert proc.returncode == 0


def test_demo_run_reaches_accuracy_above_0_8(served: httpx.Client) -> None:
    ds = upload_pairs(served, 200)
    run = submit_dpo(served, ds["id"], steps=300)
    done = wait_for(served, run["id"], lambda r: r["status"] in FINISHED)
    assert done["status"] == "succeeded", done
    final = {m["key"]: m["value"] for m in all_metrics(served, run["id"]) if m["key"].startswith("final/")}
    assert final["final/rewards/accuracy"] > 0.8


def test_cancel_a_running_run(served: httpx.Client) -> None:
    ds = upload_pairs(served, 16)
    run = submit_dpo(served, ds["id"], steps=1_000_000)
    wait_for(served, run["id"], lambda r: r["status"] == "running" and r["progress"]["step"] > 0)
    resp = served.post(f"/v1/runs/{run['id']}/cancel")
    assert resp.status_code == 200 and resp.json()["cancel_requested"]
    done = wait_for(served, run["id"], lambda r: r["status"] in FINISHED, timeout=30)
    assert done["status"] == "cancelled"
    assert served.post(f"/v1/runs/{run['id']}/cancel").status_code == 409
