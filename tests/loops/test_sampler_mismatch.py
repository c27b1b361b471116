"""The trainer/sampler mismatch in the online-RL loops: the engine's log-probs placed on the trainer's
token window, the trainer's log-probs at the sampling temperature, the truncated-IS weight in the actor's
loss (its gradient against one derived by hand), and the metrics a run logs when its engine reports
log-probs. The real engine's log-probs against the trainer's are in tests/rollout/test_served_engine.py."""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loop_context import loop_ctx
from trainer.algorithms.aggregation import batch_normaliser
from trainer.loops import LOOPS, rl_common
from trainer.loops.rl_common import ActorBatch, actor_loss, forward_logps, sampler_logps, to_token_batch
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import MemoryReporter, RunData
from trainer.rollout.base import Completion, SamplingParams
from trainer.rollout.hf_engine import HFEngine
from trainer.specs import parse_spec

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "meta": {}} for a in range(4) for b in range(4)]


@pytest.fixture(scope="module")
def tiny(tiny_cache: Path) -> tuple[Any, Any]:
    return load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))


def direct_logps(model: Any, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log softmax(z / T) of each generated token, from one unpadded forward of one sequence."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def completions(lengths: Sequence[tuple[int, int]]) -> list[Completion]:
    """Completions with prompts and outputs of the given lengths, log-probs -(row + position / 10)."""
    return [
        Completion(
            prompt_index=i,
            prompt_ids=list(range(3, 3 + p)),
            token_ids=list(range(20, 20 + t)),
            text="",
            finish_reason="length",
            logprobs=[-(i + k / 10) for k in range(t)],
        )
        for i, (p, t) in enumerate(lengths)
    ]


def test_sampler_log_probs_land_on_the_columns_of_their_tokens() -> None:
    comps = completions([(2, 3), (5, 1), (3, 4)])
    batch = to_token_batch(comps, pad_id=0, device=torch.device("cpu"))
    got = sampler_logps(comps, batch)
    assert got is not None and got.shape == batch.response_mask.shape
    for i, c in enumerate(comps):
        cols = batch.response_mask[i].nonzero()[:, 0]
        assert got[i, cols].tolist() == pytest.approx(c.logprobs)  # in order, on the response columns
        assert batch.targets[i, cols].tolist() == c.token_ids  # the columns that predict those tokens
        rest = torch.ones_like(got[i], dtype=torch.bool)
        rest[cols] = False
        assert got[i, rest].abs().sum() == 0
    # an engine that reports no log-probs (the transformers engine): nothing to compare
    assert sampler_logps([dataclasses.replace(comps[0], logprobs=None), *comps[1:]], batch) is None


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_the_trainers_log_probs_are_the_sampling_distributions(
    tiny: tuple[Any, Any], temperature: float
) -> None:
    model, tokenizer = tiny
    comps = completions([(4, 5), (2, 6)])
    batch = to_token_batch(comps, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    with torch.no_grad():
        _, logp = forward_logps(model, batch, temperature)
        for i, c in enumerate(comps):
            cols = batch.response_mask[i].nonzero()[:, 0]
            expected = direct_logps(model, c.prompt_ids, c.token_ids, temperature)
            torch.testing.assert_close(logp[i, cols].double(), expected, atol=1e-5, rtol=0)


def hyperparameters(**hp: Any) -> Any:
    return parse_spec(
        {
            "algorithm": "grpo",
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "rewards": [{"name": "numeric"}],
            "hyperparameters": {"engine": "vllm_server", **hp},
        }
    ).hyperparameters


def test_the_truncated_is_weight_scales_the_policy_gradient_per_token(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    temperature = 0.7
    hp = hyperparameters(
        policy_loss="ppo_clip",
        loss_aggregation="token_mean",
        kl_coef=0.0,
        entropy_coef=0.0,
        temperature=temperature,
    )
    comps = completions([(3, 4), (2, 5), (4, 2)])
    batch = to_token_batch(comps, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    mask = batch.response_mask
    adv = torch.tensor([1.0, -0.5, 2.0])
    weight = torch.rand(mask.shape, generator=torch.Generator().manual_seed(3)) * 2 * mask

    model.zero_grad()
    loss, _ = actor_loss(
        model,
        ActorBatch(batch, mask, adv, None, None, is_weight=weight),
        hp,
        0.0,
        batch_normaliser(mask, "token_mean"),
    )
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    # By hand: on-policy the clipped surrogate's value is -A per token and its gradient -A grad log p;
    # the weight multiplies each token's term; token mean over the counted tokens.
    model.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    for i, c in enumerate(comps):
        cols = mask[i].nonzero()[:, 0]
        logp = direct_logps(model, c.prompt_ids, c.token_ids, temperature)
        total = total - (weight[i, cols].double() * adv[i].double() * logp).sum()
    expected_loss = total / mask.sum()
    expected_loss.backward()
    assert float(loss.detach()) == pytest.approx(-float((weight * adv[:, None]).sum() / mask.sum()), rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-6, rtol=1e-4, msg=n)


class ShiftedSampler:
    """A stand-in for an engine whose kernels differ from the trainer's by a known amount: the transformers
    engine's samples, reported with log-probs ``log pi(y) - shift`` (so every ratio pi_old / pi_sampler is
    ``exp(shift)``), ``pi`` being the synced weights' distribution at the sampling temperature."""

    def __init__(self, model: Any, tokenizer: Any, shift: float):
        self.inner, self.model, self.shift = HFEngine(model, tokenizer), model, shift

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        out = self.inner.generate(prompts, n, params)
        temperature = 1.0 if params.is_greedy else params.temperature
        with torch.no_grad():
            return [
                dataclasses.replace(
                    c,
                    logprobs=(
                        direct_logps(self.model, c.prompt_ids, c.token_ids, temperature) - self.shift
                    ).tolist(),
                )
                for c in out
            ]

    def sync_weights(self, model: Any) -> None:
        self.model = model
        self.inner.sync_weights(model)

    def close(self) -> None:
        pass


def run_with_sampler(
    tiny_cache: Path,
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
    shift: float,
    algorithm: str = "grpo",
    **hp: Any,
) -> dict[str, list[float]]:
    monkeypatch.setattr(
        rl_common,
        "make_engine",
        lambda name, *, model, tokenizer, **_: ShiftedSampler(model, tokenizer, shift),
    )
    spec = parse_spec(
        {
            "algorithm": algorithm,
            "model": "tiny:llama-0.4m",
            "dataset_id": str(uuid.uuid4()),
            "rewards": [{"name": "length_penalty", "params": {"target_tokens": 2}}],
            "hyperparameters": {
                "engine": "vllm_server",  # never started: make_engine is the stand-in above
                "max_steps": 2,
                "prompts_per_step": 4,
                "samples_per_prompt": 4,
                "max_new_tokens": 6,
                "temperature": 0.8,
                "dynamic_sampling": False,
                "eval_every": 0,
                **hp,
            },
        }
    )
    reporter = MemoryReporter()
    result = LOOPS[algorithm](
        spec, RunData(train=ROWS, validation=ROWS[:2]), reporter, loop_ctx(tiny_cache, out)
    )
    assert result.status == "succeeded", reporter.events
    logged: dict[str, list[float]] = {}
    for _, key, value in reporter.metrics:
        logged.setdefault(key, []).append(value)
    return logged


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
@pytest.mark.parametrize(
    "updates",
    [{"ppo_epochs": 1, "minibatches": 1}, {"ppo_epochs": 2, "minibatches": 2}],
    ids=["on-policy", "off-policy"],
)
def test_a_run_logs_the_mismatch_its_engine_reports(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, updates: dict[str, int], algorithm: str
) -> None:
    shift = math.log(3.0)  # every token's ratio pi_old / pi_sampler is 3
    logged = run_with_sampler(
        tiny_cache, tmp_path, monkeypatch, shift, algorithm, importance_sampling_cap=2.0, **updates
    )
    assert len(logged["mismatch/logp_abs_diff"]) == 2  # every step
    for value in logged["mismatch/logp_abs_diff"]:
        assert value == pytest.approx(shift, abs=1e-4)
    for key in ("mismatch/ratio_min", "mismatch/ratio_max", "mismatch/ratio_mean"):
        assert logged[key] == pytest.approx([3.0, 3.0], abs=1e-3)
    assert logged["mismatch/ratio_std"] == pytest.approx([0.0, 0.0], abs=1e-3)
    assert logged["mismatch/kl"] == pytest.approx([3 - 1 - shift] * 2, abs=1e-3)
    assert logged["mismatch/capped_frac"] == [1.0, 1.0]


def test_without_a_cap_the_mismatch_is_logged_and_nothing_capped(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logged = run_with_sampler(tiny_cache, tmp_path, monkeypatch, 0.0)
    assert logged["mismatch/logp_abs_diff"] == pytest.approx([0.0, 0.0], abs=1e-4)  # same kernels
    assert "mismatch/capped_frac" not in logged


def test_the_cap_needs_an_engine_that_reports_log_probs() -> None:
    with pytest.raises(ValueError, match="importance_sampling_cap needs an engine"):
        hyperparameters(engine="hf", importance_sampling_cap=2.0)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        hyperparameters(importance_sampling_cap=0.5)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
@pytest.mark.parametrize("mode", ["sampler", "recompute"])
def test_old_logprobs_sampler_anchors_the_ratio_on_the_engines_log_probs_with_no_trainer_pass(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str, mode: str
) -> None:
    shift = math.log(3.0)  # the engine reports every token 3 times less likely than the trainer finds it
    passes: list[int] = []
    real = rl_common.frozen_logps
    monkeypatch.setattr(rl_common, "frozen_logps", lambda *a, **k: passes.append(1) or real(*a, **k))
    logged = run_with_sampler(
        tiny_cache,
        tmp_path,
        monkeypatch,
        shift,
        algorithm,
        old_logprobs=mode,
        kl_coef=0.0,
        ppo_epochs=2,
        minibatches=2,
    )
    # recompute: one no-grad pass of the trainer per step (no reference: kl_coef 0); sampler: none
    assert len(passes) == (0 if mode == "sampler" else 2)
    # Either way the step's mismatch is measured before the policy moves: with 'sampler' by the first
    # update's own forward pass against the old log-probs it was given, which must be the engine's.
    assert logged["mismatch/logp_abs_diff"] == pytest.approx([shift, shift], abs=1e-4)
    assert logged["mismatch/ratio_mean"] == pytest.approx([3.0, 3.0], abs=1e-3)
    assert logged["mismatch/kl"] == pytest.approx([3 - 1 - shift] * 2, abs=1e-3)
    # min / max / std do not add up over micro-batches and ranks: only the recomputed pass has them
    assert ("mismatch/ratio_max" in logged) == (mode == "recompute")


def test_with_the_samplers_log_probs_as_old_the_clipped_surrogate_sees_their_ratio(
    tiny: tuple[Any, Any],
) -> None:
    model, tokenizer = tiny
    hp = hyperparameters(
        policy_loss="ppo_clip", loss_aggregation="token_mean", kl_coef=0.0, entropy_coef=0.0, temperature=1.0
    )
    comps = completions([(3, 4), (2, 5)])
    batch = to_token_batch(comps, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    mask = batch.response_mask
    with torch.no_grad():
        trainer = forward_logps(model, batch)[1]
    sampler = (trainer - math.log(3.0)) * mask  # every ratio pi / pi_sampler is 3
    adv = torch.tensor([1.0, -0.5])
    loss, stats = actor_loss(
        model,
        ActorBatch(batch, mask, adv, sampler, None, measure_mismatch=True),
        hp,
        0.0,
        batch_normaliser(mask, "token_mean"),
    )
    # By hand, PPO's max(-A r, -A clip(r, 0.8, 1.2)) at r = 3: A = 1 -> -1.2 (clipped), A = -0.5 -> 1.5
    per_row = torch.tensor([-1.2, 1.5])
    expected = float((per_row[:, None] * mask).sum() / mask.sum())
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-4)
    assert float(stats["mismatch/ratio_mean"]) == pytest.approx(3.0, rel=1e-4)


def test_old_logprobs_sampler_needs_an_engine_that_reports_log_probs_and_no_cap() -> None:
    with pytest.raises(ValueError, match="old_logprobs 'sampler' needs an engine"):
        hyperparameters(engine="hf", old_logprobs="sampler")
    with pytest.raises(ValueError, match="importance_sampling_cap with old_logprobs 'sampler'"):
        hyperparameters(old_logprobs="sampler", importance_sampling_cap=2.0)
    assert hyperparameters(old_logprobs="sampler").old_logprobs == "sampler"
