"""A real `rlrun worker` process on Redis + PostgreSQL trains a DPO run submitted through the API."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.integration.flow import FINISHED, all_metrics, pg_redis_worker, submit_dpo, upload_pairs, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with pg_redis_worker(tmp_path_factory.mktemp("redis-pg")) as client:
        yield client


def test_dpo_run_succeeds_with_metrics_in_postgres(stack: TestClient) -> None:
    ds = upload_pairs(stack, 40)
    run = submit_dpo(stack, ds["id"], steps=20)
    done = wait_for(stack, run["id"], lambda r: r["status"] in FINISHED)
    assert done["status"] == "succeeded", done
    assert (
        done["progress"] == {"step": 20, "total_steps": 20, "phase": None, "done": None, "total": None}
        and done["attempt"] == 1
    )
    assert Path(done["output_path"], "model.safetensors").exists()
    metrics = all_metrics(stack, run["id"])
    loss_steps = sorted(m["step"] for m in metrics if m["key"] == "loss")
    assert loss_steps == list(range(1, 21))
    assert {m["key"] for m in metrics if m["key"].startswith("final/")} >= {
        "final/rewards/accuracy",
        "final/loss",
    }
    events = stack.get(f"/v1/runs/{run['id']}/events").json()["data"]
    assert [e["message"] for e in events if e["kind"] == "status"] == ["queued", "running", "succeeded"]


def test_failing_run_says_why(stack: TestClient, tmp_path: Path) -> None:
    ds = upload_pairs(stack, 8)
    # A model folder inside the roots that passes the submit check but holds no weights: the worker fails.
    home = Path(stack.app.state.settings.home)  # type: ignore[attr-defined]
    broken = home / "models" / "org" / f"broken-{uuid.uuid4().hex[:6]}"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text('{"model_type": "llama"}')
    resp = stack.post(
        "/v1/runs",
        json={
            "algorithm": "dpo",
            "model": f"org/{broken.name}",
            "dataset_id": ds["id"],
            "hyperparameters": {"max_steps": 2},
        },
    )
    assert resp.status_code == 201, resp.text
    done = wait_for(stack, resp.json()["id"], lambda r: r["status"] in FINISHED)
    assert done["status"] == "failed"
    assert "could not load model" in done["error"] and "\n" not in done["error"]
