"""How a step's rollouts become optimizer updates: ``minibatches`` / ``minibatch_size`` x ``ppo_epochs``,
when an update is on-policy (ratio 1, clipping inert), and that the clipped presets do clip."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tests.loop_context import loop_ctx
from tests.loops.addition_rows import VOWEL_REWARD
from trainer.loops.group_rl import run_group_rl
from trainer.loops.rl_common import minibatches
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import GROUP_PRESETS, PPO_PRESETS, parse_spec

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "meta": {}} for a in range(4) for b in range(4)]


def _spec(algorithm: str = "grpo", **hp: Any) -> Any:
    return parse_spec(
        {
            "algorithm": algorithm,
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "rewards": VOWEL_REWARD,
            "hyperparameters": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 6, **hp},
        }
    )


@pytest.mark.parametrize(
    ("n", "hp", "sizes"),
    [
        (10, {"ppo_epochs": 1, "minibatches": 3}, [4, 4, 2]),  # ceil(10 / 3) = 4 a time
        (16, {"ppo_epochs": 2, "minibatches": 2}, [8, 8, 8, 8]),
        (16, {"ppo_epochs": 1, "minibatches": 1}, [16]),
        (16, {"ppo_epochs": 1, "minibatches": 4, "minibatch_size": 5}, [5, 5, 5, 1]),  # the size wins
        (3, {"ppo_epochs": 1, "minibatches": 8}, [1, 1, 1]),  # never an empty minibatch
    ],
)
def test_minibatch_sizes_and_every_epoch_covers_every_rollout_once(
    n: int, hp: dict[str, Any], sizes: list[int]
) -> None:
    spec = _spec(dynamic_sampling=False, **hp).hyperparameters
    batches = list(minibatches(n, spec, torch.Generator().manual_seed(0)))
    assert [len(b) for b in batches] == sizes
    per_epoch = len(sizes) // spec.ppo_epochs
    for e in range(spec.ppo_epochs):
        seen = torch.cat(batches[e * per_epoch : (e + 1) * per_epoch])
        assert sorted(seen.tolist()) == list(range(n))


def test_on_policy_only_for_one_pass_over_one_minibatch() -> None:
    def hp(**kw: Any) -> Any:
        return _spec(dynamic_sampling=False, **kw).hyperparameters

    assert hp(ppo_epochs=1, minibatches=1).on_policy(16)
    assert hp(ppo_epochs=1, minibatches=1, minibatch_size=16).on_policy(16)
    assert hp(ppo_epochs=1, minibatches=2, minibatch_size=32).on_policy(16)  # the size wins: one minibatch
    assert not hp(ppo_epochs=1, minibatches=2).on_policy(16)
    assert not hp(ppo_epochs=2, minibatches=1).on_policy(16)
    assert not hp(ppo_epochs=1, minibatches=1, minibatch_size=8).on_policy(16)


def test_micro_batch_size_must_divide_the_minibatch_the_split_makes() -> None:
    assert _spec(minibatches=2, micro_batch_size=8).hyperparameters.minibatches == 2  # 16 / 2 = 8
    with pytest.raises(ValidationError, match=r"micro_batch_size \(16\) must divide .* \(8: "):
        _spec(minibatches=2, micro_batch_size=16)
    with pytest.raises(ValidationError, match="minibatches"):
        _spec(minibatches=0)


@pytest.mark.parametrize("algorithm", sorted(GROUP_PRESETS | PPO_PRESETS))
def test_presets_with_a_clipped_loss_take_more_than_one_update_per_batch(algorithm: str) -> None:
    hp = _spec(algorithm).hyperparameters
    updates = hp.ppo_epochs * hp.minibatches
    clipped = hp.policy_loss in ("ppo_clip", "gspo", "cispo")  # a clipped ratio or clipped IS weight
    assert (updates > 1) == clipped, (algorithm, updates, hp.policy_loss)


def _clipfracs(tiny_cache: Path, tmp_path: Path, **hp: Any) -> list[float]:
    spec = _spec(
        "grpo", max_steps=3, learning_rate=1e-2, kl_coef=0.0, dynamic_sampling=False, eval_every=0, **hp
    )
    reporter = MemoryReporter()
    result = run_group_rl(spec, RunData(train=ROWS), reporter, loop_ctx(tiny_cache, tmp_path))
    assert result.status == "succeeded"
    return [v for _, k, v in reporter.metrics if k == "policy/clipfrac"]


def test_clipping_acts_with_the_preset_and_never_on_policy(tiny_cache: Path, tmp_path: Path) -> None:
    # The preset's later updates of a batch see a ratio away from 1 (lr 1e-2 moves a 0.4M model far in one
    # step): some tokens clip. One pass over one minibatch: the ratio is exactly 1, nothing ever clips.
    assert sum(_clipfracs(tiny_cache, tmp_path / "preset")) > 0
    assert _clipfracs(tiny_cache, tmp_path / "on", ppo_epochs=1, minibatches=1) == [0.0, 0.0, 0.0]
