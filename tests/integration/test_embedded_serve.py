"""`rlrun serve` on the embedded defaults (SQLite + kombu SQL broker): no server needed.

Trains the demo's run (200 addition pairs, 300 steps) to the accuracy the README promises, and cancels a
long run end to end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import httpx
import pytest

from rlrun.demo import addition_pairs, rl_part
from tests.factories import jsonl
from tests.integration.flow import (
    FINISHED,
    all_metrics,
    embedded_server,
    serve_workers,
    submit_dpo,
    upload_pairs,
    wait_for,
)
from trainer.specs import GroupAlgorithm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("embedded")


@pytest.fixture(scope="module")
def served(home: Path) -> Iterator[httpx.Client]:
    with embedded_server(home) as client:
        yield client


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


def upload(client: httpx.Client, rows: list[dict[str, object]], kind: str) -> str:
    resp = client.post("/v1/datasets", files={"file": ("d.jsonl", jsonl(rows))}, data={"kind": kind})
    assert resp.status_code == 201, resp.text
    dataset_id: str = resp.json()["id"]
    return dataset_id


def test_pipeline_sft_then_reward_model_and_dpo(served: httpx.Client) -> None:
    sft = upload(served, [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(20)], "sft")
    prefs = upload(served, addition_pairs(40), "preference")
    hp = {"learning_rate": 1e-3, "max_steps": 6, "batch_size": 4, "checkpoint_every": 3}
    body = {
        "name": "classic",
        "stages": [
            {
                "name": "sft",
                "spec": {
                    "algorithm": "sft",
                    "model": "tiny:llama-0.4m",
                    "dataset_id": sft,
                    "hyperparameters": hp,
                },
            },
            {
                "name": "rm",
                "spec": {
                    "algorithm": "reward_model",
                    "model": "stage:sft",
                    "dataset_id": prefs,
                    "validation_fraction": 0.25,
                    "hyperparameters": hp,
                },
            },
            {
                "name": "dpo",
                "spec": {
                    "algorithm": "dpo",
                    "model": "stage:sft",
                    "dataset_id": prefs,
                    "hyperparameters": hp,
                },
            },
        ],
    }
    created = served.post("/v1/pipelines", json=body)
    assert created.status_code == 201, created.text
    pid = created.json()["id"]
    deadline = time.monotonic() + 240
    while (p := served.get(f"/v1/pipelines/{pid}").json())["status"] == "running":
        assert time.monotonic() < deadline, p
        time.sleep(0.5)
    assert p["status"] == "succeeded", p
    runs = {s["name"]: served.get(f"/v1/runs/{s['run_id']}").json() for s in p["stages"]}
    assert all(r["status"] == "succeeded" for r in runs.values())
    assert runs["rm"]["spec"]["model"] == f"run:{runs['sft']['id']}"
    ckpts = served.get(f"/v1/runs/{runs['rm']['id']}/checkpoints").json()
    assert [c["step"] for c in ckpts] == [3, 6]
    assert Path(runs["rm"]["output_path"], "reward_stats.json").exists()
    rm_keys = {m["key"] for m in all_metrics(served, runs["rm"]["id"])}
    assert {"loss", "accuracy", "eval/accuracy", "final/score_mean"} <= rm_keys


GROUP_ALGORITHMS = get_args(GroupAlgorithm)  # every group preset, as the spec names them


def test_every_online_rl_algorithm_runs_through_the_api(served: httpx.Client) -> None:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(6) for b in range(6)]
    prompts = upload(served, rows, "prompts")
    run_ids = {}
    for algorithm in GROUP_ALGORITHMS:
        spec = {
            "algorithm": algorithm,
            "model": "tiny:llama-char-0.4m",
            "dataset_id": prompts,
            "validation_fraction": 0.1,
            "rewards": [{"name": "numeric"}],
            "eval_rewards": [{"name": "exact_match"}],
            "hyperparameters": {
                "max_steps": 2,
                "prompts_per_step": 4,
                "samples_per_prompt": 4,
                "max_new_tokens": 4,
                "learning_rate": 1e-3,
                "sample_every": 1,
                "dynamic_sampling": False,
            },
        }
        resp = served.post("/v1/runs", json=spec)
        assert resp.status_code == 201, resp.text
        run_ids[algorithm] = resp.json()["id"]
    for algorithm, run_id in run_ids.items():
        done = wait_for(served, run_id, lambda r: r["status"] in FINISHED, timeout=240)
        assert done["status"] == "succeeded", (algorithm, done)
        keys = {m["key"] for m in all_metrics(served, run_id)}
        assert {"reward/mean", "policy/clipfrac", "eval/accuracy", "response/length_mean"} <= keys, algorithm
        samples = served.get(f"/v1/runs/{run_id}/samples").json()["data"]
        assert samples and {"prompt", "completion", "reward"} <= set(samples[0])


def test_demo_rl_stage_raises_heldout_accuracy_by_10_points(served: httpx.Client) -> None:
    """The README's claim: SFT to a partial accuracy, then GRPO with an exact-match verifier lifts
    held-out greedy exact match by >= 10 points (steps are fixed and seeded, not seconds). The trajectory
    depends on the CPU's float kernels: measured +32.5 points on one 2-core machine, +13.0 on another
    (AMD EPYC, AVX2), so the bound sits below both."""
    result = rl_part(served, sft_steps=350, rl_steps=300, evaluate=False)
    assert result["status"] == "succeeded", result
    assert 0.05 < result["start"] < 0.6  # SFT leaves headroom
    assert result["points"] >= 10, result


def test_the_example_openai_agent_trains_an_agent_run_on_sqlite(served: httpx.Client) -> None:
    """examples/openai_agent.py (only the `openai` SDK and httpx) as its own process against `rlrun
    serve` on the embedded defaults: it plays every episode, held-out ones included, until the run is
    over, and the run trains on them."""
    rows = [{"prompt": f"What is {a}+{b}?", "answer": str(a + b)} for a in range(5) for b in range(4)]
    spec = {
        "algorithm": "rloo",
        "model": "tiny:llama-0.4m",
        "dataset_id": upload(served, rows, "prompts"),
        "validation_fraction": 0.1,
        "agent": {"max_turns": 2, "max_episode_tokens": 48, "timeout_s": 120},
        "hyperparameters": {
            "max_steps": 2,
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "max_new_tokens": 8,
            "max_prompt_length": 160,
            "sample_every": 1,
            "dynamic_sampling": False,
        },
    }
    resp = served.post("/v1/runs", json=spec)
    assert resp.status_code == 201, resp.text
    run_id = resp.json()["id"]
    script = Path(__file__).parents[2] / "examples" / "openai_agent.py"
    agent = subprocess.run(
        [sys.executable, str(script), "--url", str(served.base_url), "--run", run_id],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert agent.returncode == 0, agent.stderr[-3000:]
    done = wait_for(served, run_id, lambda r: r["status"] in FINISHED)  # 410 comes as the run wraps up
    assert done["status"] == "succeeded", done
    held_out = 2  # 10% of 20 rows, played greedily at steps 0 and 2
    assert agent.stdout.strip() == f"played {2 * 2 * 2 + 2 * held_out} episodes"
    metrics = {(m["key"], m["step"]): m["value"] for m in all_metrics(served, run_id)}
    assert metrics[("episode/timeout_frac", 2)] == 0.0 and ("loss/total", 2) in metrics
    assert ("eval/accuracy", 0) in metrics and ("eval/accuracy", 2) in metrics


def test_a_killed_worker_is_started_again_and_takes_the_next_run(served: httpx.Client, home: Path) -> None:
    """`rlrun serve` keeps its worker: killed (as the OOM killer does), another starts, and a run sent
    afterwards trains (it sat queued for good before: nothing was left to take it)."""
    (killed,) = serve_workers(home)
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not (started := [pid for pid in serve_workers(home) if pid != killed]):
        assert time.monotonic() < deadline, "no worker was started again"
        time.sleep(0.2)
    run = submit_dpo(served, upload_pairs(served, n=40)["id"], steps=2)
    assert wait_for(served, run["id"], lambda r: r["status"] in FINISHED)["status"] == "succeeded"
    assert serve_workers(home) == started  # the run's worker, still the one started again
