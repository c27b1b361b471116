"""Evaluation runs (``algorithm: eval``): sample ``samples_per_prompt`` completions of every prompt, score
them with the spec's rewards, and report pass@k (Chen et al. 2021) and mean rewards as ``eval/*``.

Top to bottom: resolve and load the model (frozen) -> draw the rows (seeded) -> for each batch of prompts:
tokenize, generate, score, add to the running tally, log the running metrics at step = prompts done, keep
the samples with their reference answers -> the final metrics. Nothing is trained or saved: the run's result
is its metrics and samples. A cancel is checked between batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.adapter_folders import root_base
from trainer.algorithms.pass_at_k import pass_at_k
from trainer.data.prompts import PromptSet, tokenize_prompts
from trainer.loops.rollouts import build_reward, sampling_params, score
from trainer.loops.session import eval_rows, seed_everything
from trainer.models import load_causal_lm, pick_device
from trainer.precision import frozen_dtype
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.rewards.composite import RewardResult
from trainer.rollout.base import Completion
from trainer.rollout.factory import make_engine
from trainer.specs import EvalHyperparameters, EvalSpec


@dataclass
class EvalTally:
    """Running sums of an eval: each ``metrics()`` call costs the same however many prompts came before
    (an eval of 160k prompts logs after every batch). Per prompt only its pass@k terms are kept, summed."""

    n: int
    ks: Sequence[int]
    threshold: float
    prompts: int = 0
    pass_sums: dict[int, float] = field(default_factory=dict)  # k -> sum over prompts of pass@k
    samples: int = 0
    reward_sum: float = 0.0
    component_sums: dict[str, float] = field(default_factory=dict)
    length_sum: int = 0
    truncated: int = 0
    failures: int = 0

    def add(self, completions: Sequence[Completion], result: RewardResult) -> None:
        """One batch: ``completions`` prompt-major, ``n`` per prompt, and their rewards."""
        for j in range(len(completions) // self.n):
            group = result.total[j * self.n : (j + 1) * self.n]
            correct = sum(r >= self.threshold for r in group)
            for k in self.ks:
                self.pass_sums[k] = self.pass_sums.get(k, 0.0) + pass_at_k(self.n, correct, k)
            self.prompts += 1
        self.samples += len(completions)
        self.reward_sum += sum(result.total)
        for name, values in result.components.items():
            self.component_sums[name] = self.component_sums.get(name, 0.0) + sum(values)
        self.length_sum += sum(len(c.token_ids) for c in completions)
        self.truncated += sum(c.finish_reason == "length" for c in completions)
        self.failures += result.failures

    def metrics(self) -> dict[str, float]:
        """``eval/pass@k`` for each k (the unbiased estimator, averaged over prompts: Chen et al. 2021 eq.
        1), the mean reward (and each component's), response length, truncated fraction, reward failures,
        prompts so far."""
        out = {f"eval/pass@{k}": self.pass_sums[k] / self.prompts for k in self.ks}
        out |= {
            "eval/reward_mean": self.reward_sum / self.samples,
            "eval/response_length": self.length_sum / self.samples,
            "eval/truncated_frac": self.truncated / self.samples,
            "eval/reward_failures": self.failures,  # counts stay integers in the run's result
            "eval/prompts": self.prompts,
        }
        for name, total in self.component_sums.items():
            out[f"eval/reward/{name}/mean"] = total / self.samples
        return out


def sample_rows(
    completions: Sequence[Completion], prompts: PromptSet, result: RewardResult, hp: EvalHyperparameters
) -> list[dict[str, Any]]:
    """Every completion of a batch (``prompts``: the batch's rows) with its reward, whether it counts as
    correct, and the reference."""
    n = hp.samples_per_prompt
    return [
        {
            "prompt": prompts.texts[i // n],
            "completion": c.text,
            "reward": result.total[i],
            "correct": result.total[i] >= hp.pass_threshold,
            "reference": prompts.rows[i // n].get("answer"),
            "sample": i % n,
            "components": {k: v[i] for k, v in result.components.items()},
            "finish_reason": c.finish_reason,
        }
        for i, c in enumerate(completions)
    ]


def run_eval(spec: EvalSpec, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
    """Evaluate ``spec.model`` on the prompts of ``data.train``."""
    hp = spec.hyperparameters
    n = hp.samples_per_prompt
    path = ctx.resolve_model(spec.model)  # a preset is built before seeding, as in the training loops
    seed_everything(hp.seed)
    device = pick_device()
    with reporter.phase("model_load"):
        model, tokenizer = load_causal_lm(path, dtype=frozen_dtype(hp.precision, device))
        model.to(device).eval().requires_grad_(False)
        # vLLM loads a folder itself: the full model under any adapters, then takes the merged weights
        # (sync_weights).
        engine = make_engine(
            hp.engine,
            model=model,
            tokenizer=tokenizer,
            model_path=root_base(path),
            max_model_len=hp.max_prompt_length + hp.max_new_tokens,
            on_restart=lambda message: reporter.event("warning", message),
            seed=hp.seed,
        )
        ctx.cleanup.callback(engine.close)
        reward = build_reward(spec.rewards, ctx.resolve_model, device)
    rows = [data.train[i] for i in eval_rows(len(data.train), hp.max_rows or len(data.train), hp.seed)]
    ks = ", ".join(f"pass@{k}" for k in hp.ks)
    reporter.event("info", f"eval: {len(rows)} prompts x {n} samples ({ks}) of {spec.model} on {device.type}")
    tally, stored = EvalTally(n=n, ks=hp.ks, threshold=hp.pass_threshold), 0
    for first in range(0, len(rows), hp.prompts_per_batch):
        if reporter.should_stop():
            return LoopResult(status="cancelled", output_path=None, final_metrics={})
        # Tokenized a batch at a time: memory stays one batch's, however large the dataset.
        batch = rows[first : first + hp.prompts_per_batch]
        prompts = tokenize_prompts(batch, tokenizer, hp.max_prompt_length)
        params = sampling_params(hp, seed=hp.seed, first_row=first * n)
        completions = engine.generate(prompts.ids, n, params)
        owners = [i // n for i in range(len(completions))]
        result = score(completions, prompts, owners, reward, hp.max_new_tokens)
        tally.add(completions, result)
        reporter.log_metrics(tally.prompts, tally.metrics())
        if stored < hp.stored_samples:
            keep = sample_rows(completions, prompts, result, hp)[: hp.stored_samples - stored]
            reporter.log_samples(tally.prompts, keep)
            stored += len(keep)
    final = tally.metrics() if rows else {}
    summary = ", ".join(f"{k.removeprefix('eval/')} {final[k]:.4f}" for k in final if "pass@" in k)
    reporter.event("info", f"eval done: {summary or 'no prompts'} over {len(rows)} prompts")
    return LoopResult(status="succeeded", output_path=None, final_metrics=final)
