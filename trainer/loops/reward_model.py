"""Reward-model run: the LM with a fresh scalar head, trained on preference pairs or K-way rankings.

Reads top to bottom: load (seeded head) -> tokenize (one kind per dataset) -> steps (eval, checkpoints)
-> final score statistics. The score of a sequence is the head's output at its last non-pad token
(``LlamaForSequenceClassification`` finds it from ``config.pad_token_id``), so batches are right-padded
and EOS is appended only when it is not also the pad token.

Pairs are groups of two (``[chosen, rejected]``), so both kinds share one data path; the kind picks the
loss once (``REWARD_LOSSES``): Bradley-Terry with optional margin and centring for pairs (InstructGPT
eq. 1, Llama 2 eq. 2), the K-wise ranking loss over all C(K, 2) pairs for rankings.

The final checkpoint also holds ``reward_stats.json``: the mean and std of the trained model's scores over
every response of the validation set (the training set when there is none), so a later run can
normalise rewards (``read_reward_stats``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

from trainer.algorithms.preference_losses import bradley_terry, kwise_ranking
from trainer.checkpoints import Checkpointer, load_trainer_state
from trainer.loops.common import (
    EpochSampler,
    is_due,
    make_optimizer,
    pick_device,
    seed_everything,
    set_lr,
    stop_requested,
    to_floats,
    update_or_skip,
    warmup_constant_lr,
)
from trainer.loops.reward_data import (
    GroupBatch,
    TokenizedGroup,
    collate_groups,
    detect_kind,
    to_groups,
    tokenize_groups,
)
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import RewardModelSpec

REWARD_STATS_FILE = "reward_stats.json"
EVAL_BATCH_GROUPS = 32  # groups per no-grad forward pass when scoring a whole dataset


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide the load report that lists ``score.weight`` as newly initialised: that is the point here."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_reward_model(path: str) -> tuple[Any, Any]:
    """A one-label sequence classifier and its tokenizer from a causal-LM or reward-model folder.

    From a causal LM the LM head is dropped and a fresh ``score`` head is initialised from torch's RNG
    (seed before calling for a reproducible head). ``config.pad_token_id`` is set to the tokenizer's pad
    token (EOS when there is none), which is what the model uses to find the last real token.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        with _quiet_transformers():
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, use_safetensors=True, trust_remote_code=False
            )
    except OSError as exc:
        raise ValueError(f"could not load model {path!r}: {str(exc).splitlines()[0]}") from exc
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {path!r} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"  # saved with the checkpoint, so a scorer pads the same way
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def read_reward_stats(folder: Path | str) -> dict[str, Any] | None:
    """``{"mean", "std", "n", "source"}`` written next to a trained reward model, or None if absent."""
    file = Path(folder) / REWARD_STATS_FILE
    if not file.exists():
        return None
    stats: dict[str, Any] = json.loads(file.read_text())
    return stats


def sequence_scores(model: Any, batch: GroupBatch, device: torch.device) -> Tensor:
    """(N,) scalar score of every sequence of the batch, in one forward pass."""
    out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device))
    scores: Tensor = out.logits.squeeze(-1).float()
    return scores


def group_scores(model: Any, batch: GroupBatch, device: torch.device) -> Tensor:
    """(B, K) scores, best first per row; slots beyond a row's responses hold 0 (``batch.mask``)."""
    return to_groups(sequence_scores(model, batch, device), batch.index, batch.mask)


@dataclass(frozen=True)
class RewardLossParams:
    """``use_margin``: subtract a pair's ``margin`` in Bradley-Terry; ``center_coef``: its centring weight."""

    use_margin: bool = True
    center_coef: float = 0.0


def pair_loss(scores: Tensor, mask: Tensor, margins: Tensor | None, p: RewardLossParams) -> Tensor:  # noqa: ARG001
    """Mean Bradley-Terry loss of (B, 2) [chosen, rejected] scores; ``margins`` is (B,) or None."""
    return bradley_terry(
        scores[:, 0], scores[:, 1], margins if p.use_margin else None, center_coef=p.center_coef
    ).mean()


def ranking_loss(scores: Tensor, mask: Tensor, margins: Tensor | None, p: RewardLossParams) -> Tensor:  # noqa: ARG001
    """Mean K-wise ranking loss of (B, K) best-first scores; rankings carry no margin and no centring."""
    return kwise_ranking(scores, mask).mean()


# (scores (B, K) best first, mask (B, K), margins (B,) | None, params) -> scalar loss; one signature for
# both kinds, so each ignores what it does not use.
RewardLossFn = Callable[[Tensor, Tensor, Tensor | None, RewardLossParams], Tensor]
REWARD_LOSSES: Mapping[str, RewardLossFn] = MappingProxyType(
    {"preference": pair_loss, "ranking": ranking_loss}
)


def ranking_stats(scores: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Accuracy and mean margin over every (better, worse) pair; mean and std of all valid scores.

    ``scores``/``mask`` are (B, K) best first; a pair is correct when the better response scores higher
    (ties count as wrong). The std is the population std (0 for a single score, never NaN).
    """
    scores, mask = scores.detach(), mask.to(scores.device, torch.bool)
    k = scores.shape[1]
    upper = torch.triu(torch.ones(k, k, dtype=torch.bool, device=scores.device), diagonal=1)
    pair = upper & mask.unsqueeze(2) & mask.unsqueeze(1)
    diff = (scores.unsqueeze(2) - scores.unsqueeze(1))[pair]  # s_better - s_worse, one per pair
    valid = scores[mask]
    return {
        "accuracy": (diff > 0).float().mean(),
        "margin": diff.mean(),
        "scores/mean": valid.mean(),
        "scores/std": valid.std(correction=0),
    }


@dataclass(frozen=True)
class Scored:
    """Scores of a whole dataset: (G, K) best first, its (G, K) mask and (G,) margins (or None)."""

    scores: Tensor
    mask: Tensor
    margins: Tensor | None


@torch.no_grad()
def score_groups(
    model: Any, groups: list[TokenizedGroup], pad_id: int, device: torch.device, batch_groups: int
) -> Scored:
    """Score every response of ``groups`` in eval mode (no grad), ``batch_groups`` groups per pass."""
    was_training = model.training
    model.eval()
    k_max = max(len(g.sequences) for g in groups)
    chunks, masks = [], []
    for i in range(0, len(groups), batch_groups):
        batch = collate_groups(groups[i : i + batch_groups], pad_id)
        pad = k_max - batch.mask.shape[1]
        chunks.append(F.pad(group_scores(model, batch, device).cpu(), (0, pad)))
        masks.append(F.pad(batch.mask, (0, pad)))
    model.train(was_training)
    margins = None
    if any(g.margin is not None for g in groups):
        margins = torch.tensor([g.margin if g.margin is not None else 0.0 for g in groups])
    return Scored(scores=torch.cat(chunks), mask=torch.cat(masks), margins=margins)


def evaluate(
    scored: Scored, loss_fn: RewardLossFn, params: RewardLossParams, prefix: str
) -> dict[str, float]:
    """``<prefix>/loss``, ``/accuracy``, ``/margin``, ``/scores_mean``, ``/scores_std`` of a scored set."""
    stats = ranking_stats(scored.scores, scored.mask)
    stats["loss"] = loss_fn(scored.scores, scored.mask, scored.margins, params)
    return {f"{prefix}/{k.replace('/', '_')}": v for k, v in to_floats(stats).items()}


def reward_stats(scored: Scored, source: str) -> dict[str, Any]:
    """Mean and (population) std of every response's score: what a consumer normalises rewards with."""
    valid = scored.scores[scored.mask]
    return {
        "mean": float(valid.mean()),
        "std": float(valid.std(correction=0)),
        "n": int(valid.numel()),
        "source": source,
    }


class _TokenizerAndFiles:
    """Saves the tokenizer plus extra files into a checkpoint folder.

    ``Checkpointer.save`` writes a temporary folder, renames it and only then announces it; handing it
    this in place of the tokenizer puts ``reward_stats.json`` into the folder before it is announced.
    """

    def __init__(self, tokenizer: Any, files: Mapping[str, str]):
        self.tokenizer, self.files = tokenizer, files

    def save_pretrained(self, folder: Path | str) -> None:
        self.tokenizer.save_pretrained(folder)
        for name, text in self.files.items():
            (Path(folder) / name).write_text(text)


def run_reward_model(
    spec: RewardModelSpec, data: RunData, reporter: Reporter, ctx: LoopContext
) -> LoopResult:
    """Train a scalar reward head (and the LM under it) on ``data``'s pairs or rankings."""
    hp = spec.hyperparameters
    # Resolve first (building a tiny preset draws from torch's RNG), then seed, then load: the fresh score
    # head is drawn from the seeded RNG, so it is the same whether or not the preset was already built.
    model_path = str(ctx.resume_from) if ctx.resume_from else ctx.resolve_model(spec.model)
    gen = seed_everything(hp.seed)
    device = pick_device()
    model, tokenizer = load_reward_model(model_path)
    model.to(device)
    pad_id = tokenizer.pad_token_id

    kind = detect_kind(data.train)
    if data.validation and detect_kind(data.validation) != kind:
        raise ValueError(f"the training rows are {kind} rows but the validation rows are not")
    groups = tokenize_groups(data.train, kind, tokenizer, max_length=hp.max_length)
    val_groups = tokenize_groups(data.validation, kind, tokenizer, max_length=hp.max_length)
    loss_fn = REWARD_LOSSES[kind]
    params = RewardLossParams(use_margin=hp.use_margin, center_coef=hp.center_coef)
    optimizer = make_optimizer(model, hp.lr, hp.weight_decay)
    sampler = EpochSampler(len(groups), hp.batch_size, gen)
    checkpointer = Checkpointer(
        ctx.checkpoint_dir,
        reporter,
        keep_last=hp.keep_last_checkpoints,
        best_metric=hp.best_metric,
        best_mode=hp.best_mode,
    )
    start = 0
    if ctx.resume_from is not None:
        start = load_trainer_state(ctx.resume_from, optimizer=optimizer, sampler=sampler).step
        reporter.event("info", f"resumed from checkpoint at step {start}")
    if kind == "ranking" and hp.center_coef > 0:
        reporter.event("warning", "center_coef applies to preference pairs only; ignored for rankings")
    reporter.event(
        "info",
        f"training a reward model on {len(groups)} {kind} rows ({len(val_groups)} validation) for "
        f"{hp.max_steps} steps on {device.type}",
    )

    if start >= hp.max_steps and ctx.resume_from is not None:  # the final checkpoint was already written
        return LoopResult(status="succeeded", output_path=ctx.resume_from)
    model.train()
    last_eval: dict[str, float] = {}

    def keep_work(s: int) -> object:  # a checkpoint of the steps done, when a cancel or pause stops us
        return checkpointer.save(
            s, model=model, tokenizer=tokenizer, optimizer=optimizer, sampler=sampler, metrics=last_eval
        )

    for step in range(start + 1, hp.max_steps + 1):
        if stop_requested(reporter, step, start, checkpointer.saved, keep_work):
            return LoopResult(status="cancelled", output_path=None)
        t0 = time.perf_counter()
        batch = collate_groups([groups[i] for i in sampler.next_batch()], pad_id)
        lr = warmup_constant_lr(step, base_lr=hp.lr, warmup_steps=hp.warmup_steps)
        set_lr(optimizer, lr)

        scores = group_scores(model, batch, device)  # all B*K sequences in one forward pass
        mask = batch.mask.to(device)
        margins = batch.margins.to(device) if batch.margins is not None else None
        loss = loss_fn(scores, mask, margins, params)
        grad_norm = update_or_skip(
            model,
            optimizer,
            loss,
            max_grad_norm=hp.max_grad_norm,
            step=step,
            on_nonfinite=hp.on_nonfinite,
            reporter=reporter,
        )

        metrics: dict[str, float] = {}
        if is_due(step, hp.log_every, hp.max_steps):
            stats = ranking_stats(scores, mask) | {"loss": loss.detach(), "grad_norm": grad_norm}
            metrics = to_floats(stats) | {
                "lr": lr,
                "perf/tokens_per_s": batch.n_tokens / (time.perf_counter() - t0),
            }
        val_scored = None
        if val_groups and is_due(step, hp.eval_every, hp.max_steps):
            val_scored = score_groups(model, val_groups, pad_id, device, EVAL_BATCH_GROUPS)
            last_eval = evaluate(val_scored, loss_fn, params, "eval")
            metrics |= last_eval
        if metrics:
            reporter.log_metrics(step, metrics)
        if is_due(step, hp.checkpoint_every, hp.max_steps):
            final_step = step == hp.max_steps
            saver: Any = tokenizer
            if final_step:  # score statistics of the trained model, stored with it
                if val_scored is not None:
                    source, scored = "validation", val_scored
                else:
                    source, scored = "train", score_groups(model, groups, pad_id, device, EVAL_BATCH_GROUPS)
                stats_json = reward_stats(scored, source)
                final = ranking_stats(scored.scores, scored.mask)
                final_metrics = {
                    "final/score_mean": stats_json["mean"],
                    "final/score_std": stats_json["std"],
                    "final/accuracy": float(final["accuracy"]),
                }
                reporter.log_metrics(step, final_metrics)
                metrics |= final_metrics
                saver = _TokenizerAndFiles(tokenizer, {REWARD_STATS_FILE: json.dumps(stats_json, indent=1)})
            path = checkpointer.save(
                step,
                model=model,
                tokenizer=saver,
                optimizer=optimizer,
                sampler=sampler,
                metrics=metrics | last_eval,
            )
            if final_step:
                reporter.event("info", f"final reward model saved to {path} (score stats from {source})")
                return LoopResult(status="succeeded", output_path=path, final_metrics=final_metrics)
    raise AssertionError("unreachable: the last step always returns")
