"""A real `rlrun worker` process on Redis + PostgreSQL trains a DPO run submitted through the API."""

from __future__ import annotations

import json
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


# Two policy turns per episode: the environment answers the first with "again" and pays for a vowel in
# each turn (the random tiny model writes one about half the time, so groups differ).
ENVIRONMENT = """
def reset(row):
    return [{"role": "user", "content": row["prompt"]}]

def step(messages, row):
    turns = sum(m["role"] == "assistant" for m in messages)
    paid = float(any(v in messages[-1]["content"] for v in "aeiou"))
    if turns >= 2:
        return {"reward": paid, "done": True}
    return {"messages": [{"role": "user", "content": "again"}], "reward": paid, "done": False}
"""


def test_a_stored_environment_drives_a_grpo_run_through_the_worker(stack: TestClient) -> None:
    rows = "".join(
        json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a in range(4) for b in range(4)
    )
    ds = stack.post("/v1/datasets", files={"file": ("p.jsonl", rows.encode())}, data={"kind": "prompts"})
    assert ds.status_code == 201, ds.text
    env = stack.post("/v1/environments", json={"name": "again", "source": ENVIRONMENT})
    assert env.status_code == 201, env.text
    spec = {
        "algorithm": "grpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": ds.json()["id"],
        "environment": {"id": env.json()["id"], "max_turns": 3},
        "hyperparameters": {
            "max_steps": 2,
            "prompts_per_step": 2,
            "samples_per_prompt": 4,
            "max_new_tokens": 8,
            "max_prompt_length": 32,
            "dynamic_sampling": False,
            "learning_rate": 1e-3,
            "sample_every": 1,
        },
    }
    run = stack.post("/v1/runs", json=spec)
    assert run.status_code == 201, run.text
    done = wait_for(stack, run.json()["id"], lambda r: r["status"] in FINISHED)
    assert done["status"] == "succeeded", done
    metrics = {(m["key"], m["step"]): m["value"] for m in all_metrics(stack, run.json()["id"])}
    for step in (1, 2):
        assert metrics[("episode/done_frac", step)] + metrics[("episode/length_frac", step)] == 1.0
        assert 1.0 <= metrics[("episode/turns_mean", step)] <= 2.0
        assert metrics[("reward/environment/mean", step)] == metrics[("reward/mean", step)]
    samples = stack.get(f"/v1/runs/{run.json()['id']}/samples").json()["data"]
    transcript = samples[0]["data"]["transcript"]
    assert transcript[0]["role"] == "assistant"
    assert all(m["content"] == "again" for m in transcript if m["role"] == "user")
    assert samples[0]["prompt"].startswith("user: ") and samples[0]["prompt"].endswith("\nassistant: ")
