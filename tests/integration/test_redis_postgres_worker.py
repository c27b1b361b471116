"""A real `rlrun worker` process on Redis + PostgreSQL trains a DPO run submitted through the API."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def test_an_openai_sdk_agent_trains_a_grpo_run_through_the_api_and_a_real_worker(stack: TestClient) -> None:
    """An agent program that uses only the official `openai` SDK (and plain HTTP for its episodes and
    rewards) plays every episode of a run; its two calls per episode become one sample each."""
    import openai

    rows = "".join(json.dumps({"prompt": f"Say a word with {c}.", "answer": c}) + "\n" for c in "aeioubcdfg")
    ds = stack.post("/v1/datasets", files={"file": ("p.jsonl", rows.encode())}, data={"kind": "prompts"})
    assert ds.status_code == 201, ds.text
    spec = {
        "algorithm": "grpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": ds.json()["id"],
        "agent": {"timeout_s": 120, "max_turns": 2, "max_episode_tokens": 64},
        "hyperparameters": {
            "max_steps": 2,
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "max_new_tokens": 8,
            "max_prompt_length": 48,
            "dynamic_sampling": False,
            "learning_rate": 1e-3,
            "sample_every": 1,
            "eval_max_rows": 2,
        },
    }
    run = stack.post("/v1/runs", json=spec)
    assert run.status_code == 201, run.text
    run_id = run.json()["id"]
    played: list[tuple[dict[str, Any], list[Any]]] = []
    answers: list[int] = []

    def agent() -> None:
        while True:
            got = stack.get(f"/v1/runs/{run_id}/agent/episodes/next", params={"wait": 2})
            answers.append(got.status_code)
            if got.status_code == 410:
                return
            if got.status_code != 200:  # not started yet (409), nothing on offer (204)
                time.sleep(0.2)
                continue
            episode = got.json()
            client = openai.OpenAI(base_url=episode["base_url"], api_key="unused", http_client=stack)
            messages: list[Any] = [{"role": "user", "content": episode["row"]["prompt"]}]
            replies = []
            for _ in range(2):
                reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
                replies.append(reply)
                messages += [reply.choices[0].message, {"role": "user", "content": "Another?"}]
            text = replies[-1].choices[0].message.content or ""
            posted = stack.post(
                episode["reward_url"], json={"reward": float(episode["row"]["answer"] in text)}
            )
            assert posted.status_code == 200, posted.text
            played.append((episode, replies))

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    done = wait_for(stack, run_id, lambda r: r["status"] in FINISHED)
    thread.join(30)
    assert done["status"] == "succeeded", done
    assert answers[-1] == 410 and not thread.is_alive()
    assert sum(not e["evaluation"] for e, _ in played) == 8  # 2 steps x 2 prompts x 2 samples
    metrics = {(m["key"], m["step"]): m["value"] for m in all_metrics(stack, run_id)}
    for step in (1, 2):
        assert metrics[("episode/turns_mean", step)] == 2.0 and metrics[("episode/timeout_frac", step)] == 0.0
        assert metrics[("reward/agent/mean", step)] == metrics[("reward/mean", step)]
    assert ("loss/total", 2) in metrics and metrics[("adv/std", 2)] > 0  # it trained on the episodes
    # the samples show the transcripts the agent saw, replies as the endpoint returned them
    returned = {r.choices[0].message.content for _, replies in played for r in replies}
    samples = stack.get(f"/v1/runs/{run_id}/samples").json()["data"]
    for sample in samples:
        shown = [m["content"] for m in sample["data"]["transcript"] if m["role"] == "assistant"]
        assert len(shown) == 2 and set(shown) <= returned
    other = submit_dpo(stack, upload_pairs(stack, 8)["id"], steps=1)
    refused = stack.get(f"/v1/runs/{other['id']}/agent/episodes/next", params={"wait": 0})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "not_an_agent_run"
