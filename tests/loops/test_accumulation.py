"""Gradient accumulation in every run kind: a step cut into micro-batches (``micro_batch_size``) makes the
same update as the whole batch at once, so the trained weights match; metrics stay one per optimizer step.
And a micro_batch_size that does not divide the step's batch is refused with the field named."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tests.loop_context import loop_ctx
from tests.loops.addition_rows import PAIRS, PROMPTS, SFT, VOWEL_REWARD
from trainer.loops import LOOPS
from trainer.models import load_causal_lm, load_reward_model
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

RL_HP = {"prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 4, "minibatch_size": 8}

CASES: dict[str, tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]] = {
    "sft": ({}, SFT, {"batch_size": 4}),
    "dpo": ({}, PAIRS, {"batch_size": 4}),
    "reward_model": ({}, PAIRS, {"batch_size": 4}),
    "grpo": (
        {"rewards": VOWEL_REWARD},
        PROMPTS,
        {**RL_HP, "loss_aggregation": "seq_mean_token_mean"},
    ),
    "dr_grpo": ({"rewards": VOWEL_REWARD}, PROMPTS, RL_HP),
    "ppo": ({"rewards": VOWEL_REWARD}, PROMPTS, {**RL_HP, "loss_aggregation": "seq_mean_token_sum"}),
}


def spec(algorithm: str, micro: int | None) -> Any:
    extra, _, hp = CASES[algorithm]
    return parse_spec(
        {
            "algorithm": algorithm,
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            **extra,
            "hyperparameters": {"max_steps": 2, "learning_rate": 1e-3, "micro_batch_size": micro, **hp},
        }
    )


def trained(algorithm: str, micro: int | None, tiny_cache: Path, out: Path) -> tuple[Any, MemoryReporter]:
    s = spec(algorithm, micro)
    reporter = MemoryReporter()
    result = LOOPS[s.algorithm](s, RunData(train=CASES[algorithm][1]), reporter, loop_ctx(tiny_cache, out))
    assert result.status == "succeeded"
    load = load_reward_model if algorithm == "reward_model" else load_causal_lm
    model, _ = load(str(result.output_path))
    return model, reporter


@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_micro_batches_make_the_whole_batch_update(algorithm: str, tiny_cache: Path, tmp_path: Path) -> None:
    whole, whole_rep = trained(algorithm, None, tiny_cache, tmp_path / "whole")
    micro, micro_rep = trained(algorithm, 2, tiny_cache, tmp_path / "micro")
    key = "loss" if algorithm in ("sft", "dpo", "reward_model") else "loss/total"
    assert len(micro_rep.series(key)) == 2  # one value per optimizer step, not per micro-batch
    assert micro_rep.series(key) == pytest.approx(whole_rep.series(key), rel=1e-4, abs=1e-6)
    assert micro_rep.series("grad_norm") == pytest.approx(whole_rep.series("grad_norm"), rel=1e-4)
    # Adam divides each element's gradient by its own running scale, so an embedding row whose exact
    # gradient is 0 (a token seen only where nothing is scored) moves by up to lr * g / (|g| + eps) for
    # float noise g ~ 1e-10 from a different batch shape: 3e-5 here after 2 steps at lr 1e-3. A wrong
    # update (a micro-batch missed, or counted twice) moves elements by ~lr; its scale shows in grad_norm.
    for (name, a), (_, b) in zip(whole.named_parameters(), micro.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_a_micro_batch_size_that_does_not_divide_the_batch_is_refused() -> None:
    with pytest.raises(ValidationError) as offline:
        spec("dpo", 3)
    assert offline.value.errors()[0]["loc"][-1] == "micro_batch_size"
    assert "must divide batch_size (4)" in str(offline.value)
    with pytest.raises(ValidationError, match=r"micro_batch_size \(3\) must divide the completions of one"):
        spec("grpo", 3)
