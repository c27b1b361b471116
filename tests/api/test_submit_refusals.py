"""Runs that could not learn are refused at submit, the field named (issue 13 item 3): a group baseline
with one sample per prompt, a reward model as a policy, a causal LM as a reward model, adaptive KL from 0.
Nothing is stored for a refused run."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import Run
from api.settings import Settings
from tests.factories import api_client, dpo_spec, make_dataset, make_run

PROMPTS = [{"prompt": "1+1=", "answer": "2"}]


def rl(dataset_id: uuid.UUID, algorithm: str = "grpo", **over: Any) -> dict[str, Any]:
    hp = over.pop("hyperparameters", {})
    return {
        "algorithm": algorithm,
        "model": "tiny:llama-0.4m",
        "dataset_id": str(dataset_id),
        "rewards": [{"name": "exact_match"}],
        "hyperparameters": {"max_steps": 2, **hp},
        **over,
    }


def count(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Run)) or 0)


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
def test_a_group_baseline_with_one_sample_per_prompt_is_refused(session: Session, algorithm: str) -> None:
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    before = count(session)
    with api_client(session) as client:
        one = client.post(
            "/v1/runs", json=rl(prompts.id, algorithm, hyperparameters={"samples_per_prompt": 1})
        )
        two = client.post(
            "/v1/runs", json=rl(prompts.id, algorithm, hyperparameters={"samples_per_prompt": 2})
        )
    assert one.status_code == 422, one.text
    assert one.json()["error"]["field"] == "hyperparameters.samples_per_prompt"
    assert "every advantage is 0" in one.json()["error"]["message"]
    assert two.status_code == 201 and count(session) == before + 1


@pytest.mark.parametrize("algorithm", ["reinforce", "reinforce_pp", "remax", "ppo"])
def test_baselines_that_need_no_group_allow_one_sample(session: Session, algorithm: str) -> None:
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    with api_client(session) as client:
        resp = client.post(
            "/v1/runs", json=rl(prompts.id, algorithm, hyperparameters={"samples_per_prompt": 1})
        )
    assert resp.status_code == 201, resp.text


def test_adaptive_kl_from_zero_is_refused(session: Session) -> None:
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    before = count(session)
    with api_client(session) as client:
        preset_zero = client.post(  # Dr.GRPO's preset has no KL
            "/v1/runs", json=rl(prompts.id, "dr_grpo", hyperparameters={"kl_controller": "adaptive"})
        )
        given_zero = client.post(
            "/v1/runs",
            json=rl(prompts.id, "ppo", hyperparameters={"kl_controller": "adaptive", "kl_coef": 0}),
        )
        preset_nonzero = client.post(  # GRPO's preset starts at 0.04
            "/v1/runs", json=rl(prompts.id, "grpo", hyperparameters={"kl_controller": "adaptive"})
        )
    for resp in (preset_zero, given_zero):
        assert resp.status_code == 422 and resp.json()["error"]["field"] == "hyperparameters.kl_coef", (
            resp.text
        )
    assert preset_nonzero.status_code == 201 and count(session) == before + 1


def test_an_adapter_with_the_vllm_engine_and_an_online_micro_batch_that_does_not_divide_are_refused(
    session: Session,
) -> None:
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    before = count(session)
    with api_client(session) as client:
        vllm = client.post(
            "/v1/runs", json=rl(prompts.id, adapter={"r": 4}, hyperparameters={"engine": "vllm"})
        )
        micro = client.post(  # 8 prompts x 4 samples = 32 completions per step; 5 does not divide them
            "/v1/runs",
            json=rl(
                prompts.id,
                hyperparameters={"prompts_per_step": 8, "samples_per_prompt": 4, "micro_batch_size": 5},
            ),
        )
        fits = client.post(
            "/v1/runs",
            json=rl(
                prompts.id, adapter={"r": 4}, hyperparameters={"samples_per_prompt": 4, "micro_batch_size": 8}
            ),
        )
    assert vllm.status_code == 422 and "adapter with engine 'vllm'" in vllm.json()["error"]["message"], (
        vllm.text
    )
    assert micro.status_code == 422 and "micro_batch_size (5) must divide" in micro.json()["error"]["message"]
    assert fits.status_code == 201, fits.text
    assert count(session) == before + 1


def test_a_kto_batch_of_one_is_refused_naming_the_field(session: Session) -> None:
    """In a batch of one, KTO's reference point would pair the example with its own answer (issue 41)."""
    unpaired = make_dataset(
        session,
        rows=[
            {"prompt": "1+1=", "completion": "2", "label": True},
            {"prompt": "2+2=", "completion": "5", "label": False},
        ],
        kind="unpaired",
    )
    before = count(session)
    spec = {"algorithm": "kto", "model": "tiny:llama-0.4m", "dataset_id": str(unpaired.id)}
    with api_client(session) as client:
        one = client.post("/v1/runs", json=spec | {"hyperparameters": {"batch_size": 1}})
        two = client.post("/v1/runs", json=spec | {"hyperparameters": {"batch_size": 2}})
    assert one.status_code == 422, one.text
    assert one.json()["error"]["field"] == "hyperparameters.batch_size"
    assert "another example's answer" in one.json()["error"]["message"]
    assert two.status_code == 201 and count(session) == before + 1


def test_reward_models_are_no_policies_and_causal_lms_no_reward_models(
    session: Session, tmp_path: Path
) -> None:
    prefs = make_dataset(session)
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    rm = make_run(session, prefs, algorithm="reward_model", status="succeeded", output_path="/tmp/rm")
    sft = make_run(session, prefs, algorithm="sft", status="succeeded", output_path="/tmp/sft")
    settings = Settings(home=tmp_path)
    for name, arch in (("org/causal", "LlamaForCausalLM"), ("org/scorer", "LlamaForSequenceClassification")):
        folder = tmp_path / "models" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"architectures": [arch]}))

    def reward(model: str) -> list[dict[str, Any]]:
        return [{"name": "reward_model", "model": model}]

    before = count(session)
    refused = {
        "model": {**dpo_spec(prefs.id), "model": f"run:{rm.id}"},
        "reference_model": {**dpo_spec(prefs.id), "reference_model": f"run:{rm.id}"},
        "rewards[0].model": rl(prompts.id, rewards=reward(f"run:{sft.id}")),
        "eval_rewards[0].model": rl(prompts.id, eval_rewards=reward("tiny:llama-0.4m")),
        "rewards[0].model ": rl(prompts.id, rewards=reward("org/causal")),
    }
    with api_client(session, settings=settings) as client:
        answers = {field: client.post("/v1/runs", json=spec) for field, spec in refused.items()}
        assert count(session) == before
        accepted = [
            client.post("/v1/runs", json=rl(prompts.id, rewards=reward(f"run:{rm.id}"))),
            client.post("/v1/runs", json=rl(prompts.id, rewards=reward("org/scorer"))),
            # A causal-LM critic is PPO's default (a fresh value head on the policy); an RM critic too.
            client.post("/v1/runs", json=rl(prompts.id, "ppo", critic_model=f"run:{sft.id}")),
            client.post("/v1/runs", json=rl(prompts.id, "ppo", critic_model=f"run:{rm.id}")),
        ]
    for field, resp in answers.items():
        assert resp.status_code == 422, (field, resp.text)
        assert resp.json()["error"]["field"] == field.strip(), (field, resp.json())
    assert "cannot generate" in answers["model"].json()["error"]["message"]
    assert "score head would be random" in answers["rewards[0].model"].json()["error"]["message"]
    assert [r.status_code for r in accepted] == [201] * 4, [r.text for r in accepted]


def test_pipeline_stages_get_the_same_refusals(session: Session) -> None:
    prefs = make_dataset(session)
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    sft_ds = make_dataset(session, rows=[{"prompt": "p", "completion": "c"}], kind="sft")
    rm_stage = {
        "name": "rm",
        "spec": {"algorithm": "reward_model", "model": "tiny:llama-0.4m", "dataset_id": str(prefs.id)},
    }
    cases = {
        "stages[1].spec.model": {"name": "dpo", "spec": {**dpo_spec(prefs.id), "model": "stage:rm"}},
        "stages[1].spec.hyperparameters.samples_per_prompt": {
            "name": "grpo",
            "spec": rl(prompts.id, hyperparameters={"samples_per_prompt": 1}),
        },
    }
    with api_client(session) as client:
        for field, stage in cases.items():
            resp = client.post("/v1/pipelines", json={"stages": [rm_stage, stage]})
            assert resp.status_code == 422 and resp.json()["error"]["field"] == field, resp.text
        sft_stage = {
            "name": "sft",
            "spec": {"algorithm": "sft", "model": "tiny:llama-0.4m", "dataset_id": str(sft_ds.id)},
        }
        as_reward = client.post(
            "/v1/pipelines",
            json={
                "stages": [
                    sft_stage,
                    {
                        "name": "g",
                        "spec": rl(prompts.id, rewards=[{"name": "reward_model", "model": "stage:sft"}]),
                    },
                ]
            },
        )
    assert (
        as_reward.status_code == 422
        and as_reward.json()["error"]["field"] == "stages[1].spec.rewards[0].model"
    )


def test_a_reward_model_run_may_start_from_a_reward_model(session: Session) -> None:
    prefs = make_dataset(session)
    rm = make_run(session, prefs, algorithm="reward_model", status="succeeded", output_path="/tmp/rm")
    with api_client(session) as client:
        resp = client.post(
            "/v1/runs",
            json={"algorithm": "reward_model", "model": f"run:{rm.id}", "dataset_id": str(prefs.id)},
        )
    assert resp.status_code == 201, resp.text


def test_a_retry_with_the_same_idempotency_key_gets_the_same_run(session: Session, tmp_path: Path) -> None:
    """The stored spec holds the learning rate picked at submit; a retry that left it out is the same."""
    prefs = make_dataset(session)
    folder = tmp_path / "models" / "org" / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    spec = {"algorithm": "dpo", "model": "org/m", "dataset_id": str(prefs.id)}
    with api_client(session, settings=Settings(home=tmp_path)) as client:
        first = client.post("/v1/runs", json=spec, headers={"Idempotency-Key": "k1"})
        again = client.post("/v1/runs", json=spec, headers={"Idempotency-Key": "k1"})
        other = client.post("/v1/runs", json={**spec, "name": "x"}, headers={"Idempotency-Key": "k1"})
    assert first.status_code == 201 and again.status_code == 201, again.text
    assert first.json()["id"] == again.json()["id"]
    assert other.status_code == 409


def test_malformed_run_references_are_422_not_500(session: Session) -> None:
    sft = make_dataset(session, rows=[{"prompt": "p", "completion": "c"}], kind="sft")
    with api_client(session) as client:
        run = client.post(
            "/v1/runs", json={"algorithm": "sft", "model": "run:" + "-" * 36, "dataset_id": str(sft.id)}
        )
        job = client.post(
            "/v1/fine_tuning/jobs", json={"model": "run:" + "-" * 36, "training_file": f"file-{sft.id.hex}"}
        )
        best = client.post(
            "/v1/runs",
            json={
                "algorithm": "sft",
                "model": "tiny:llama-0.4m",
                "dataset_id": str(sft.id),
                "hyperparameters": {"best_metric": "a\x00b"},
            },
        )
    assert run.status_code == 422 and run.json()["error"]["field"] == "model", run.text
    assert job.status_code == 400 and job.json()["error"]["param"] == "model", job.text
    assert best.status_code == 422 and best.json()["error"]["field"] == "hyperparameters.best_metric", (
        best.text
    )


DEVICE_REFUSALS = [
    ({"devices": 3}, {}, "dpo", "resources.devices (3) must divide hyperparameters.batch_size (4)"),
    ({"devices": 2}, {"micro_batch_size": 4}, "dpo", "micro_batch_size (4) must divide each device's share"),
    ({"devices": 2}, {}, "reward_model", "supported for sft, dpo and the group family"),
    ({"devices": 2}, {}, "ppo", "so far, not ppo"),
    (
        {"devices": 2},
        {"prompts_per_step": 3},
        "grpo",
        "devices (2) must divide hyperparameters.prompts_per_step (3)",
    ),
    ({"devices": 2}, {"engine": "vllm"}, "grpo", "engine 'vllm' on several devices is not supported yet"),
    (
        {"devices": 2},
        {"engine": "vllm_server", "async_rollouts": 1},
        "grpo",
        "engine 'vllm_server' on several devices with hyperparameters.async_rollouts is not supported yet",
    ),
    # across hosts the batch splits over nodes x devices ranks
    (
        {"nodes": 3},
        {},
        "dpo",
        "resources.devices x resources.nodes (3) must divide hyperparameters.batch_size",
    ),
    ({"nodes": 2, "devices": 2}, {"batch_size": 6}, "dpo", "x resources.nodes (4) must divide"),
    ({"nodes": 2}, {}, "ppo", "resources.devices x resources.nodes > 1 is supported for sft, dpo"),
    ({"nodes": 65}, {}, "dpo", "resources.nodes"),
]


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_an_adapter_on_several_ranks_with_the_engine_process_is_taken(
    session: Session, sharding: str
) -> None:
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    spec = rl(
        prompts.id,
        adapter={"r": 4},
        hyperparameters={"engine": "vllm_server"},
        resources={"devices": 2, "sharding": sharding},
    )
    before = count(session)
    with api_client(session) as client:
        accepted = client.post("/v1/runs", json=spec)
    assert accepted.status_code == 201, accepted.text
    assert count(session) == before + 1


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_the_engine_process_across_hosts_is_taken_under_either_sharding(
    session: Session, sharding: str
) -> None:
    prompts = make_dataset(session, rows=PROMPTS, kind="prompts")
    spec = rl(
        prompts.id, hyperparameters={"engine": "vllm_server"}, resources={"nodes": 2, "sharding": sharding}
    )
    before = count(session)
    with api_client(session) as client:
        accepted = client.post("/v1/runs", json=spec)
    assert accepted.status_code == 201, accepted.text
    assert count(session) == before + 1


@pytest.mark.parametrize(("resources", "hp", "algorithm", "message"), DEVICE_REFUSALS)
def test_a_multi_device_spec_that_cannot_split_its_batch_is_refused(
    session: Session, resources: dict[str, Any], hp: dict[str, Any], algorithm: str, message: str
) -> None:
    pairs = make_dataset(session)
    if algorithm in ("ppo", "grpo"):
        spec = {**rl(pairs.id, algorithm, hyperparameters=hp), "resources": resources}
    else:
        spec = {**dpo_spec(pairs.id, **hp), "algorithm": algorithm, "resources": resources}
    before = count(session)
    with api_client(session) as client:
        resp = client.post("/v1/runs", json=spec)
    assert resp.status_code == 422, resp.text
    assert message in resp.text
    assert count(session) == before


def test_more_devices_than_any_worker_has_is_refused_when_the_operator_says_how_many(
    session: Session,
) -> None:
    pairs = make_dataset(session)
    spec = {**dpo_spec(pairs.id), "resources": {"devices": 4, "sharding": "fsdp"}}
    with api_client(session, Settings(worker_devices=2)) as client:
        refused = client.post("/v1/runs", json=spec)
        fits = client.post("/v1/runs", json={**spec, "resources": {"devices": 2, "sharding": "fsdp"}})
    with api_client(session) as client:  # not declared: the worker checks at start
        unchecked = client.post("/v1/runs", json=spec)
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "resources.devices"
    assert "no worker of this deployment has more than 2" in refused.json()["error"]["message"]
    assert fits.status_code == 201 and unchecked.status_code == 201


def test_more_hosts_than_the_deployment_has_is_refused_when_the_operator_says_how_many(
    session: Session,
) -> None:
    pairs = make_dataset(session)
    spec = {**dpo_spec(pairs.id), "resources": {"nodes": 4}}
    with api_client(session, Settings(worker_hosts=2)) as client:
        refused = client.post("/v1/runs", json=spec)
        fits = client.post("/v1/runs", json={**spec, "resources": {"nodes": 2}})
    with api_client(session) as client:  # not declared: the run waits for its hosts
        unchecked = client.post("/v1/runs", json=spec)
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "resources.nodes"
    assert "4 hosts asked, but this deployment has 2 worker host(s)" in refused.json()["error"]["message"]
    assert fits.status_code == 201 and unchecked.status_code == 201
