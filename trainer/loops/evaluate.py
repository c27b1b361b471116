"""Evaluation runs (``algorithm: eval``): sample ``samples_per_prompt`` completions of every prompt, score
them with the spec's rewards, and report pass@k (Chen et al. 2021) and mean rewards as ``eval/*``.

Top to bottom: resolve and load the model (frozen) -> draw the rows (seeded) -> tokenize -> for each batch
of prompts: generate, score, add to the tally, log the running metrics at step = prompts done, keep the
samples with their reference answers -> the final metrics. Nothing is trained or saved: the run's result
is its metrics and samples. A cancel is checked between batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.adapters import base_of, is_adapter_folder
from trainer.algorithms.pass_at_k import mean_pass_at_k
from trainer.data.prompts import PromptSet, tokenize_prompts
from trainer.loops.common import seed_everything
from trainer.loops.rollouts import build_reward, score
from trainer.loops.session import eval_rows
from trainer.models import load_causal_lm, pick_device
from trainer.precision import frozen_dtype
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.rewards.composite import RewardResult
from trainer.rollout.base import Completion, SamplingParams
from trainer.rollout.factory import make_engine
from trainer.specs import EvalHyperparameters, EvalSpec


@dataclass
class EvalTally:
    """Running totals of an eval: per prompt its number of correct samples, per sample its reward."""

    n: int
    ks: Sequence[int]
    threshold: float
    correct: list[int] = field(default_factory=list)  # per prompt: samples with reward >= threshold
    rewards: list[float] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)
    truncated: int = 0
    failures: int = 0

    def add(self, completions: Sequence[Completion], result: RewardResult) -> None:
        """One batch: ``completions`` prompt-major, ``n`` per prompt, and their rewards."""
        for j in range(len(completions) // self.n):
            group = result.total[j * self.n : (j + 1) * self.n]
            self.correct.append(sum(r >= self.threshold for r in group))
        self.rewards += result.total
        for name, values in result.components.items():
            self.components.setdefault(name, []).extend(values)
        self.lengths += [len(c.token_ids) for c in completions]
        self.truncated += sum(c.finish_reason == "length" for c in completions)
        self.failures += result.failures

    def metrics(self) -> dict[str, float]:
        """``eval/pass@k`` for each k (the unbiased estimator, averaged over prompts), the mean reward (and
        each component's), response length, truncated fraction, reward failures, prompts so far."""
        out = {f"eval/pass@{k}": mean_pass_at_k(self.correct, self.n, k) for k in self.ks}
        out |= {
            "eval/reward_mean": sum(self.rewards) / len(self.rewards),
            "eval/response_length": sum(self.lengths) / len(self.lengths),
            "eval/truncated_frac": self.truncated / len(self.lengths),
            "eval/reward_failures": float(self.failures),
            "eval/prompts": float(len(self.correct)),
        }
        for name, values in self.components.items():
            out[f"eval/reward/{name}/mean"] = sum(values) / len(values)
        return out


def sampling(hp: EvalHyperparameters, first_row: int) -> SamplingParams:
    """Sampling for the batch whose first sample is global sample ``first_row``: each sample's draws are
    keyed by the seed and its global index, so they do not depend on ``prompts_per_batch``."""
    assert hp.temperature is not None  # filled from samples_per_prompt when the spec is validated
    return SamplingParams(
        max_new_tokens=hp.max_new_tokens,
        temperature=hp.temperature,
        top_p=hp.top_p,
        top_k=hp.top_k,
        greedy=hp.greedy,
        seed=hp.seed,
        first_row=first_row,
    )


def sample_rows(
    completions: Sequence[Completion], prompts: PromptSet, idx: Sequence[int], result: RewardResult, hp: Any
) -> list[dict[str, Any]]:
    """Every completion of a batch with its reward, whether it counts as correct, and the reference."""
    out = []
    for i, c in enumerate(completions):
        row = prompts.rows[idx[i // hp.samples_per_prompt]]
        out.append(
            {
                "prompt": prompts.texts[idx[i // hp.samples_per_prompt]],
                "completion": c.text,
                "reward": result.total[i],
                "correct": result.total[i] >= hp.pass_threshold,
                "reference": row.get("answer"),
                "sample": i % hp.samples_per_prompt,
                "components": {k: v[i] for k, v in result.components.items()},
                "finish_reason": c.finish_reason,
            }
        )
    return out


def run_eval(spec: EvalSpec, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
    """Evaluate ``spec.model`` on the prompts of ``data.train``."""
    hp = spec.hyperparameters
    n = hp.samples_per_prompt
    path = ctx.resolve_model(spec.model)  # a preset is built before seeding, as in the training loops
    seed_everything(hp.seed)
    device = pick_device()
    with reporter.phase("model_load"):
        model, tokenizer = load_causal_lm(path, dtype=frozen_dtype(hp.precision))
        model.to(device).eval().requires_grad_(False)
        # vLLM loads a folder itself: an adapter run's base, then takes the merged weights (sync_weights).
        engine_path = base_of(path) if is_adapter_folder(path) else path
        engine = make_engine(hp.engine, model=model, tokenizer=tokenizer, model_path=engine_path)
        reward = build_reward(spec.rewards, ctx.resolve_model, device)
    rows = [data.train[i] for i in eval_rows(len(data.train), hp.max_rows or len(data.train), hp.seed)]
    with reporter.phase("tokenize", len(rows)) as progress:
        prompts = tokenize_prompts(rows, tokenizer, hp.max_prompt_length)
        progress.advance(len(rows))
    ks = ", ".join(f"pass@{k}" for k in hp.ks)
    reporter.event(
        "info", f"eval: {len(rows)} prompts x {n} samples ({ks}) of {spec.model} on {device.type}"
    )
    tally, stored = EvalTally(n=n, ks=hp.ks, threshold=hp.pass_threshold), 0
    for first in range(0, len(rows), hp.prompts_per_batch):
        if reporter.should_stop():
            return LoopResult(status="cancelled", output_path=None, final_metrics={})
        idx = list(range(first, min(first + hp.prompts_per_batch, len(rows))))
        completions = engine.generate([prompts.ids[j] for j in idx], n, sampling(hp, first * n))
        result = score(
            completions, prompts, [idx[i // n] for i in range(len(completions))], reward, hp.max_new_tokens
        )
        tally.add(completions, result)
        done = idx[-1] + 1
        reporter.log_metrics(done, tally.metrics())
        if stored < hp.stored_samples:
            keep = sample_rows(completions, prompts, idx, result, hp)[: hp.stored_samples - stored]
            reporter.log_samples(done, keep)
            stored += len(keep)
    final = tally.metrics() if rows else {}
    summary = ", ".join(f"{k.removeprefix('eval/')} {final[k]:.4f}" for k in final if "pass@" in k)
    reporter.event("info", f"eval done: {summary or 'no prompts'} over {len(rows)} prompts")
    return LoopResult(status="succeeded", output_path=None, final_metrics=final)
