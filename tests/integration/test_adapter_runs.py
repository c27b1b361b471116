"""Every run kind trains a LoRA adapter with gradient accumulation through the REST API, with a real
`rlrun worker` process on Redis + PostgreSQL; an adapter run's `run:<id>` starts the next run."""

from __future__ import annotations

import io
import math
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.factories import jsonl
from tests.integration.flow import FINISHED, all_metrics, pg_redis_worker, wait_for
from tests.loops.addition_rows import pairs, prompts, sft
from trainer.adapters import BASE_FILE, base_of, is_adapter_folder

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GSM8K = Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "test.jsonl"  # copied from shared/data


def number_of(text: str) -> float | None:
    """The answer number as GSM8K writes it (after ``####``), else the last number; commas dropped."""
    tail = text.rsplit("####", 1)[-1].replace(",", "")
    found = re.findall(r"-?\d+(?:\.\d+)?", tail)
    return float(found[-1]) if found else None


ADAPTER = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
PAIRS, SFT, PROMPTS = pairs(6), sft(6), prompts(6)
# dynamic_sampling off: "numeric" on a random-init model gives every group equal rewards, and the grpo
# preset's dynamic sampling would then skip every update this test counts.
RL_HP = {
    "prompts_per_step": 2,
    "samples_per_prompt": 4,
    "max_new_tokens": 4,
    "kl_coef": 0.05,
    "dynamic_sampling": False,
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with pg_redis_worker(tmp_path_factory.mktemp("adapter-runs")) as c:
        yield c


def upload(client: TestClient, rows: list[dict[str, Any]], kind: str) -> str:
    resp = client.post("/v1/datasets", files={"file": ("d.jsonl", jsonl(rows))}, data={"kind": kind})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def submit(
    client: TestClient, algorithm: str, dataset_id: str, model: str = "tiny:llama-0.4m", **extra: Any
) -> str:
    hp = extra.pop("hyperparameters", {})
    spec = {
        "algorithm": algorithm,
        "model": model,
        "dataset_id": dataset_id,
        "adapter": ADAPTER,
        **extra,
        "hyperparameters": {"max_steps": 2, "learning_rate": 1e-3, **hp},
    }
    resp = client.post("/v1/runs", json=spec)
    assert resp.status_code == 201, resp.text
    assert resp.json()["spec"]["adapter"]["r"] == 4
    return str(resp.json()["id"])


def test_every_run_kind_trains_an_adapter_with_accumulation(
    client: TestClient, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pairs, sft, prompts = (
        upload(client, PAIRS, "preference"),
        upload(client, SFT, "sft"),
        upload(client, PROMPTS, "prompts"),
    )
    unpaired = upload(
        client,
        [
            {"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in PAIRS
            for side in ("chosen", "rejected")
        ],
        "unpaired",
    )
    offline = {"batch_size": 4, "micro_batch_size": 2}
    online = {**RL_HP, "micro_batch_size": 4}
    runs = {
        "sft": submit(client, "sft", sft, hyperparameters=offline),
        "reward_model": submit(client, "reward_model", pairs, hyperparameters=offline),
        "dpo": submit(client, "dpo", pairs, hyperparameters=offline),
        "grpo": submit(client, "grpo", prompts, rewards=[{"name": "numeric"}], hyperparameters=online),
        "ppo": submit(client, "ppo", prompts, rewards=[{"name": "numeric"}], hyperparameters=online),
        # issue 22's run types: reference-free preference losses and the newer policy losses
        "orpo": submit(client, "orpo", pairs, hyperparameters=offline),
        "simpo": submit(client, "dpo", pairs, hyperparameters=offline | {"loss_type": "simpo"}),
        "kto": submit(client, "kto", unpaired, hyperparameters=offline),
        "gspo": submit(client, "gspo", prompts, rewards=[{"name": "numeric"}], hyperparameters=online),
        "cispo": submit(client, "cispo", prompts, rewards=[{"name": "numeric"}], hyperparameters=online),
    }
    for algorithm, run_id in runs.items():
        done = wait_for(client, run_id, lambda r: r["status"] in FINISHED)
        assert done["status"] == "succeeded", (algorithm, done)
        losses = [m["value"] for m in all_metrics(client, run_id) if m["key"] in ("loss", "loss/total")]
        assert losses and all(math.isfinite(v) for v in losses), (algorithm, losses)
        output = Path(done["output_path"])
        assert is_adapter_folder(output) and (output / BASE_FILE).exists(), algorithm
        assert not (output / "model.safetensors").exists(), algorithm  # the adapter, not a model copy
        steps = sorted({m["step"] for m in all_metrics(client, run_id) if m["key"] == "grad_norm"})
        assert steps == [1, 2], (algorithm, steps)  # one metric per optimizer step
    # An adapter run is a model for the next run: DPO (with its own adapter) from the SFT adapter run.
    chained = submit(client, "dpo", pairs, model=f"run:{runs['sft']}", hyperparameters=offline)
    done = wait_for(client, chained, lambda r: r["status"] in FINISHED)
    assert done["status"] == "succeeded", done
    first_loss = [m["value"] for m in all_metrics(client, chained) if m["key"] == "loss" and m["step"] == 1]
    assert first_loss and abs(first_loss[0] - 0.693147) < 1e-4  # its reference is the SFT model: log 2
    # format=hf of an adapter run: a merge run (a worker job) folds the adapter into its base first.
    sft_run = runs["sft"]
    refused = client.get(f"/v1/runs/{sft_run}/export", params={"format": "hf"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "merge_required"
    made = client.post("/v1/runs", json={"algorithm": "merge", "model": f"run:{sft_run}"})
    assert made.status_code == 201, made.text
    merged = wait_for(client, made.json()["id"], lambda r: r["status"] in FINISHED)
    assert merged["status"] == "succeeded", merged
    exported = client.get(f"/v1/runs/{sft_run}/export", params={"format": "hf"})
    assert exported.status_code == 200, exported.text
    folder = tmp_path_factory.mktemp("merged")
    with tarfile.open(fileobj=io.BytesIO(exported.content)) as tar:
        tar.extractall(folder, filter="data")
    (root,) = [p.parent for p in folder.rglob("config.json")]
    assert f"merged into its base by merge run `{made.json()['id']}`" in (root / "README.md").read_text()
    adapter_folder = client.get(f"/v1/runs/{sft_run}").json()["output_path"]
    base = AutoModelForCausalLM.from_pretrained(base_of(adapter_folder))
    ids = torch.tensor([[1, 5, 9, 14, 20]])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(root)(input_ids=ids).logits  # no peft needed
        expected = PeftModel.from_pretrained(base, adapter_folder)(input_ids=ids).logits
    torch.testing.assert_close(plain, expected, rtol=1e-5, atol=1e-5)
    # An eval run scores that chained adapter model on the real GSM8K file with the numeric verifier.
    gsm8k = client.post(
        "/v1/datasets", files={"file": ("gsm8k.jsonl", GSM8K.read_bytes())}, data={"kind": "prompts"}
    ).json()["id"]
    spec = {
        "algorithm": "eval",
        "model": f"run:{chained}",
        "dataset_id": gsm8k,
        "rewards": [{"name": "numeric"}],
        "hyperparameters": {"max_rows": 4, "samples_per_prompt": 3, "max_new_tokens": 8},
    }
    resp = client.post("/v1/runs", json=spec)
    assert resp.status_code == 201 and resp.json()["progress"]["total_steps"] == 4, resp.text
    done = wait_for(client, resp.json()["id"], lambda r: r["status"] in FINISHED)
    assert done["status"] == "succeeded" and done["output_path"] is None, done
    final = {m["key"]: m["value"] for m in all_metrics(client, done["id"]) if m["step"] == 4}
    samples = client.get(f"/v1/runs/{done['id']}/samples", params={"limit": 100}).json()["data"]
    assert len(samples) == 12 and all(s["data"]["reference"].split("#### ")[1] for s in samples)
    right = [number_of(s["completion"]) == number_of(s["data"]["reference"]) for s in samples]
    assert [s["reward"] for s in samples] == [float(r) for r in right]  # the numeric verdict, recomputed
    assert final["eval/pass@1"] == sum(right) / 12 and final["eval/prompts"] == 4
    assert set(final) >= {"eval/pass@3", "eval/reward_mean", "eval/reward/numeric/mean"}


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"adapter": {**ADAPTER, "quantize": "4bit"}}, "quantize '4bit' (QLoRA) needs a CUDA GPU"),
        ({"hyperparameters": {"precision": "fp16"}}, "precision 'fp16' needs a CUDA GPU"),
    ],
    ids=["qlora", "fp16"],
)
def test_a_cuda_only_spec_on_a_worker_without_cuda_fails_at_start_saying_why(
    client: TestClient, extra: dict[str, Any], reason: str
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this worker has CUDA")
    sft = upload(client, SFT, "sft")
    resp = client.post(
        "/v1/runs", json={"algorithm": "sft", "model": "tiny:llama-0.4m", "dataset_id": sft, **extra}
    )
    assert resp.status_code == 201, resp.text
    done = wait_for(client, resp.json()["id"], lambda r: r["status"] in FINISHED)
    assert done["status"] == "failed" and reason in done["error"], done
    events = client.get(f"/v1/runs/{done['id']}/events").json()["data"]
    failed = [e for e in events if e["kind"] == "status" and e["message"] == "failed"]
    assert len(failed) == 1 and reason in failed[0]["data"]["error"], events  # its events say why
