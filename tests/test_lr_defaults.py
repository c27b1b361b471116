"""Default learning rates by model size (issue 13 item 4): the size estimate against published parameter
counts, the table's rows, and the rate the API stores for each kind of model reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from api.settings import Settings
from tests.factories import api_client, dpo_spec, make_dataset, make_run
from trainer.lr_defaults import approx_params, default_learning_rate, preset_params
from trainer.specs import TINY_PRESETS

LLAMA2_7B = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008, "vocab_size": 32000}
QWEN25_05B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def test_parameter_estimates_match_published_sizes() -> None:
    # Llama 2 7B: 6.74B parameters (Touvron et al. 2023, Table 1 rounds to 7B; the model card says 6.74B).
    assert approx_params(LLAMA2_7B) == pytest.approx(6.74e9, rel=0.01)
    # Qwen2.5-0.5B: 0.49B parameters (its model card), tied embeddings. Attention with grouped KV heads
    # is smaller than 4 h^2, so the estimate is a little high; it only has to pick the right row.
    assert approx_params(QWEN25_05B) == pytest.approx(0.49e9, rel=0.1)
    assert approx_params({"hidden_size": 8}) is None  # no layer count: not a size we can read


@pytest.mark.parametrize("preset", sorted(TINY_PRESETS))
def test_preset_sizes_match_the_built_models(preset: str, tiny_cache: Path) -> None:
    """Against the parameters of the model actually built (norms are the only part left out); the presets
    of 100M parameters and more are built on the meta device (the same modules, no memory, no disk)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from trainer.models import build_tiny_tokenizer, tiny_config, tiny_model_dir

    if preset_params(TINY_PRESETS[preset]) < 100e6:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(preset, tiny_cache))
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(tiny_config(preset, build_tiny_tokenizer()))
    built = sum(p.numel() for p in model.parameters())
    assert preset_params(TINY_PRESETS[preset]) == pytest.approx(built, rel=0.01)


@pytest.mark.parametrize(
    ("algorithm", "n_params", "rate"),
    [
        ("dpo", 458_752, 1e-3),
        ("grpo", 458_752, 2e-4),
        ("ppo", 50_000_000, 2e-4),
        ("sft", 50_000_001, 2e-5),
        ("dpo", 494_000_000, 1e-6),
        ("reward_model", 6_740_000_000, 5e-6),
        ("dpo", 6_740_000_000, 5e-7),
        ("sft", 70_000_000_000, 5e-6),
        ("dpo", None, 5e-7),  # unknown size: the 1B-15B row
    ],
)
def test_the_table(algorithm: str, n_params: int | None, rate: float) -> None:
    assert default_learning_rate(algorithm, n_params) == rate


@pytest.mark.parametrize(
    ("algorithm", "n_params", "full", "lora"),
    [
        ("grpo", 458_752, 2e-4, 2e-4),  # the tiny row is the presets' measured rate, adapter or not
        ("sft", 50_000_000, 1e-3, 1e-3),
        ("grpo", 134_515_008, 1e-6, 5e-5),  # SmolLM2-135M: online RL with LoRA measured (not 10x)
        ("ppo", 500_000_000, 1e-6, 5e-5),
        ("grpo", 500_000_001, 1e-6, 1e-5),  # above the measured sizes: the 10x rule
        ("dpo", 134_515_008, 1e-6, 1e-5),  # the measurement is online RL's only
        ("dpo", 494_000_000, 1e-6, 1e-5),
        ("dpo", 6_740_000_000, 5e-7, 5e-6),
        ("sft", 70_000_000_000, 5e-6, 5e-5),
        ("dpo", None, 5e-7, 5e-6),  # unknown size: the 1B-15B row
    ],
)
def test_a_lora_adapter_takes_ten_times_the_rate(
    algorithm: str, n_params: int | None, full: float, lora: float
) -> None:
    # LoRA Without Regret (Schulman et al. 2025): LoRA's best rate is ~10x full fine-tuning's; online RL
    # up to 500M takes the rate bench/real_model.py measured (trainer/lr_defaults.py).
    assert default_learning_rate(algorithm, n_params) == pytest.approx(full)
    assert default_learning_rate(algorithm, n_params, lora=True) == pytest.approx(lora)


def test_the_api_stores_the_rate_for_the_models_size(session: Session, tmp_path: Path) -> None:
    prefs = make_dataset(session)
    folder = tmp_path / "models" / "meta" / "llama-2-7b"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(LLAMA2_7B))
    tiny_sft = make_run(
        session,
        prefs,
        algorithm="sft",
        status="succeeded",
        output_path="/tmp/sft",
        spec={**dpo_spec(prefs.id), "algorithm": "sft"},
    )
    big_sft = make_run(
        session,
        prefs,
        algorithm="sft",
        status="succeeded",
        output_path="/tmp/sft7b",
        spec={**dpo_spec(prefs.id), "algorithm": "sft", "model": "meta/llama-2-7b"},
    )
    hp = {"max_steps": 2}
    cases = {
        "tiny:llama-0.4m": 1e-3,
        "meta/llama-2-7b": 5e-7,
        f"run:{tiny_sft.id}": 1e-3,  # a run's size is the size of the model it started from
        f"run:{big_sft.id}": 5e-7,
    }
    with api_client(session, settings=Settings(home=tmp_path)) as client:
        stored = {}
        for model, _ in cases.items():
            resp = client.post("/v1/runs", json={**dpo_spec(prefs.id), "model": model, "hyperparameters": hp})
            assert resp.status_code == 201, resp.text
            stored[model] = resp.json()["spec"]["hyperparameters"]["learning_rate"]
        given = client.post(
            "/v1/runs",
            json={
                **dpo_spec(prefs.id),
                "model": "meta/llama-2-7b",
                "hyperparameters": {"learning_rate": 3e-6},
            },
        )
        lora = {"type": "lora", "r": 8}
        adapter_runs = {
            model: client.post(
                "/v1/runs",
                json={**dpo_spec(prefs.id), "model": model, "adapter": lora, "hyperparameters": hp},
            )
            for model in ("tiny:llama-0.4m", "meta/llama-2-7b")
        }
    assert stored == cases
    assert given.json()["spec"]["hyperparameters"]["learning_rate"] == 3e-6
    for resp in adapter_runs.values():
        assert resp.status_code == 201, resp.text
    # a LoRA run on the 7B folder: 10 x 5e-7; on the tiny preset its measured rate, as without an adapter
    assert adapter_runs["meta/llama-2-7b"].json()["spec"]["hyperparameters"][
        "learning_rate"
    ] == pytest.approx(5e-6)
    assert adapter_runs["tiny:llama-0.4m"].json()["spec"]["hyperparameters"]["learning_rate"] == 1e-3
