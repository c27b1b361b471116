"""Default learning rates by run family and model size (torch-free: the API picks one at submit).

A spec that leaves ``learning_rate`` out gets the rate of its family for the model's size, and the stored
spec holds the rate picked. One default for all sizes fails both ends: 1e-6 (a good DPO rate for a 7B
model) leaves a 0.4M-parameter preset at loss ln 2, and 1e-3 (what the presets need) wrecks a 7B model.

| parameters   | sft  | reward_model | dpo  | online RL | source                                       |
|--------------|------|--------------|------|-----------|----------------------------------------------|
| up to 50M    | 1e-3 | 1e-3         | 1e-3 | 2e-4      | the tiny presets: this repo's demo and tests |
| up to 1.5B   | 2e-5 | 1e-5         | 1e-6 | 1e-6      | TRL's SFT/Reward/DPO/GRPO config defaults    |
| up to 15B    | 1e-5 | 5e-6         | 5e-7 | 1e-6      | Tulu 3 (Lambert et al. 2024): 8B SFT and DPO |
| larger       | 5e-6 | 2e-6         | 2e-7 | 5e-7      | Tulu 3 70B                                   |
| unknown size | the "up to 15B" row: cautious for the models users bring (1B-8B)              |

ORPO and KTO runs take the dpo column (TRL's defaults for them are its DPO one). The numbers are starting
points; the held-out learning benchmarks are where they get measured.

A LoRA adapter (the spec's ``adapter``) takes ``LORA_FACTOR`` (10) times the full fine-tuning rate on the
rows above 50M: "LoRA Without Regret" (Schulman et al., Thinking Machines 2025) finds LoRA's best rate
about 10x full fine-tuning's across model sizes, for SFT and RL alike (rank-independent with alpha fixed
and the 1/r scale, as peft's). Where a LoRA rate was measured here it replaces the rule
(``LORA_MEASURED``): online RL on models up to 500M takes 5e-5. GRPO + LoRA r 16 on
SmolLM2-135M-Instruct's chat-form word problems, 15 steps x 32 completions, held-out greedy accuracy
from 23% (100 problems; ``bench/real_model.py --contenders grpo --lr-sweep 1e-6,1e-5,5e-5,2e-4 --steps
15 --heldout 100 --set dynamic_sampling=false``, 2026-12-06): 1e-6 (the table's full rate) +0 points,
1e-5 (the 10x rule) +1, 5e-5 +6 with every chat answer as the base's, 2e-4 +16 with the France question
answered in French. The tiny row is the presets' own measured rates, with or without an adapter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

Family = Literal["sft", "reward_model", "dpo", "online_rl"]

LR_TABLE: tuple[tuple[float, dict[Family, float]], ...] = (
    (50e6, {"sft": 1e-3, "reward_model": 1e-3, "dpo": 1e-3, "online_rl": 2e-4}),
    (1.5e9, {"sft": 2e-5, "reward_model": 1e-5, "dpo": 1e-6, "online_rl": 1e-6}),
    (15e9, {"sft": 1e-5, "reward_model": 5e-6, "dpo": 5e-7, "online_rl": 1e-6}),
    (float("inf"), {"sft": 5e-6, "reward_model": 2e-6, "dpo": 2e-7, "online_rl": 5e-7}),
)
UNKNOWN_SIZE_ROW = 2
TINY_LIMIT = LR_TABLE[0][0]
LORA_FACTOR = 10.0
# LoRA rates measured here, replacing the 10x rule: (largest model size, family, rate).
LORA_MEASURED: tuple[tuple[float, Family, float], ...] = ((500e6, "online_rl", 5e-5),)


def family_of(algorithm: str) -> Family:
    if algorithm in ("sft", "reward_model", "dpo"):
        return algorithm  # type: ignore[return-value]
    if algorithm in ("orpo", "kto"):  # preference losses: TRL's ORPO and KTO defaults are its DPO one
        return "dpo"
    return "online_rl"


def approx_params(config: Mapping[str, Any]) -> int | None:
    """Parameters of a decoder-only transformer from its ``config.json``: embeddings (and an untied LM
    head) plus, per layer, attention ``4 h^2`` and a gated MLP ``3 h i``; norms and biases are noise at this
    precision. None when the config lacks the sizes (not a Llama/Qwen/Mistral-shaped model)."""
    try:
        h = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        vocab = int(config.get("vocab_size", 32_000))
        inter = int(config.get("intermediate_size") or 4 * h)
    except (KeyError, TypeError, ValueError):
        return None
    heads = 1 if config.get("tie_word_embeddings", False) else 2
    return heads * vocab * h + layers * (4 * h * h + 3 * h * inter)


def preset_params(dims: Mapping[str, int]) -> int:
    """A tiny preset's size, from its dimensions (vocabulary: the 512-symbol BPE or 259 characters)."""
    vocab = 259 if dims.get("char_level") else 512
    return approx_params({**dims, "vocab_size": vocab}) or 0


def default_learning_rate(algorithm: str, n_params: int | None, *, lora: bool = False) -> float:
    """The table's rate for ``algorithm``'s family at ``n_params`` (None: unknown size); with ``lora`` (the
    run trains a LoRA adapter) above the tiny row, the measured LoRA rate where there is one
    (``LORA_MEASURED``), else ``LORA_FACTOR`` times the table's."""
    family = family_of(algorithm)
    if n_params is None:
        rate = LR_TABLE[UNKNOWN_SIZE_ROW][1][family]
    else:
        rate = next(rates[family] for limit, rates in LR_TABLE if n_params <= limit)
    if not lora or (n_params is not None and n_params <= TINY_LIMIT):
        return rate
    if n_params is not None:
        measured = (r for limit, f, r in LORA_MEASURED if f == family and n_params <= limit)
        return next(measured, rate * LORA_FACTOR)
    return rate * LORA_FACTOR


def preset_params_of(model: str) -> int | None:
    """The size of a ``tiny:`` model reference from its name alone (None for any other reference)."""
    from trainer.specs.refs import TINY_PRESETS  # here, from its own module: trainer.specs imports this one

    dims = TINY_PRESETS.get(model.removeprefix("tiny:")) if model.startswith("tiny:") else None
    return preset_params(dims) if dims is not None else None
