"""Cancel and pause land within 5 s in every long phase, with a real `rlrun worker` process on Redis +
PostgreSQL. Each phase is stretched to a minute with the test-only hook RLRUN_TEST_PHASE_DELAY (on the
tiny preset each takes milliseconds); the run shows the phase (`progress.phase`) while it is in it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.factories import jsonl
from tests.integration.flow import FINISHED, pg_redis_worker, upload_pairs, wait_for
from trainer.phases import TEST_DELAY_ENV

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BOUND_SECONDS = 5.0
STRETCH_SECONDS = 60  # far past the bound: the phase cannot end by itself while the test waits


class Stack:
    def __init__(self, client: TestClient, delays: Path):
        self.client, self.delays = client, delays
        self.pairs = upload_pairs(client, 40)["id"]
        rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
        resp = client.post("/v1/datasets", files={"file": ("p.jsonl", jsonl(rows))}, data={"kind": "prompts"})
        assert resp.status_code == 201, resp.text
        self.prompts = resp.json()["id"]

    def stretch(self, phase: str) -> None:
        self.delays.write_text(json.dumps({phase: STRETCH_SECONDS}))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("phase-stops")
    delays = home / "delays.json"
    delays.write_text("{}")
    with pg_redis_worker(home, {TEST_DELAY_ENV: str(delays)}) as client:
        yield Stack(client, delays)


def dpo(stack: Stack, **hp: Any) -> str:
    spec = {
        "algorithm": "dpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": stack.pairs,
        "validation_fraction": 0.2,  # held-out pairs: an eval phase
        "hyperparameters": {"learning_rate": 1e-3, "max_steps": 2, "batch_size": 8, **hp},
    }
    resp = stack.client.post("/v1/runs", json=spec)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def grpo(stack: Stack) -> str:
    spec = {
        "algorithm": "grpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": stack.prompts,
        "rewards": [{"name": "numeric"}],
        "hyperparameters": {
            "max_steps": 2,
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "max_new_tokens": 3,
        },
    }
    resp = stack.client.post("/v1/runs", json=spec)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def stop_in_phase(
    stack: Stack, run_id: str, phase: str, action: str, ends: tuple[str, ...]
) -> dict[str, Any]:
    """Wait until the run shows ``phase``, ask for ``action``; return the run once it reached ``ends``,
    asserting that took under BOUND_SECONDS."""
    shown = wait_for(
        stack.client, run_id, lambda r: r["progress"]["phase"] == phase or r["status"] in FINISHED
    )
    assert shown["progress"]["phase"] == phase, shown
    asked = time.monotonic()
    resp = stack.client.post(f"/v1/runs/{run_id}/{action}")
    assert resp.status_code == 200, resp.text
    done = wait_for(stack.client, run_id, lambda r: r["status"] in ends, timeout=60)
    took = time.monotonic() - asked
    print(f"{action} during {phase}: landed in {took:.2f} s")
    assert took < BOUND_SECONDS, f"{action} during {phase} took {took:.1f} s"
    assert done["progress"]["phase"] is None
    events = stack.client.get(f"/v1/runs/{run_id}/events", params={"limit": 500}).json()["data"]
    progress = [e for e in events if e["kind"] == "progress"]
    assert progress and progress[0]["data"]["phase"] == phase
    return done


@pytest.mark.parametrize(
    ("phase", "hp"),
    [
        ("model_load", {}),
        ("tokenize", {}),
        ("reference", {"reference_mode": "precompute"}),
        ("eval", {}),
        ("final_metrics", {}),
        ("checkpoint", {"checkpoint_every": 1}),
    ],
)
def test_cancel_lands_within_5_s_in_each_dpo_phase(stack: Stack, phase: str, hp: dict[str, Any]) -> None:
    stack.stretch(phase)
    done = stop_in_phase(stack, dpo(stack, **hp), phase, "cancel", FINISHED)
    assert done["status"] == "cancelled" and done["output_path"] is None


def test_cancel_lands_within_5_s_during_rollouts(stack: Stack) -> None:
    stack.stretch("rollouts")
    assert stop_in_phase(stack, grpo(stack), "rollouts", "cancel", FINISHED)["status"] == "cancelled"


def test_pause_lands_within_5_s_in_a_reference_pass_and_the_run_resumes(stack: Stack) -> None:
    stack.stretch("reference")
    run_id = dpo(stack, reference_mode="lazy")
    assert stop_in_phase(stack, run_id, "reference", "pause", ("paused", *FINISHED))["status"] == "paused"
    stack.stretch("none")
    assert stack.client.post(f"/v1/runs/{run_id}/resume").status_code == 200
    done = wait_for(stack.client, run_id, lambda r: r["status"] in FINISHED)
    assert done["status"] == "succeeded" and done["progress"]["step"] == 2
