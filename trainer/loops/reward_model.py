"""Reward-model run: the LM with a fresh scalar head, trained on preference pairs or K-way rankings.

Reads top to bottom: load (seeded head) -> tokenize (one kind per dataset) -> steps (eval, checkpoints)
-> final score statistics. The score of a sequence is the head's output at its last non-pad token
(``LlamaForSequenceClassification`` finds it from ``config.pad_token_id``), so batches are right-padded
and EOS is appended only when it is not also the pad token.

Pairs are groups of two (``[chosen, rejected]``), so both kinds share one data path; the kind picks the
loss once (``REWARD_LOSSES``): Bradley-Terry with optional margin and centring for pairs (InstructGPT
eq. 1, Llama 2 eq. 2), the K-wise ranking loss over all C(K, 2) pairs for rankings.

The final checkpoint also holds ``reward_stats.json``: the mean and std of the trained model's scores over
every response of the validation set (the training set when there is none), at most ``eval_max_rows`` rows
of it, so a later run can normalise rewards (``read_reward_stats``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.algorithms.preference_losses import bradley_terry, kwise_ranking
from trainer.data.reward import (
    GroupBatch,
    TokenizedGroup,
    collate_groups,
    detect_kind,
    to_groups,
    tokenize_groups,
)
from trainer.loops.session import Final, TrainingSession, begin, eval_rows, load_trainable, to_floats
from trainer.models import REWARD_STATS_FILE, sequence_scores
from trainer.phases import Phase
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import RewardModelSpec

EVAL_BATCH_GROUPS = 32  # groups per no-grad forward pass when scoring a whole dataset


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
    model: Any,
    groups: list[TokenizedGroup],
    pad_id: int,
    device: torch.device,
    batch_groups: int,
    progress: Phase | None = None,
) -> Scored:
    """Score every response of ``groups`` in eval mode (no grad), ``batch_groups`` groups per pass;
    ``progress`` counts groups."""
    was_training = model.training
    model.eval()
    k_max = max(len(g.sequences) for g in groups)
    chunks, masks = [], []
    for i in range(0, len(groups), batch_groups):
        batch = collate_groups(groups[i : i + batch_groups], pad_id)
        pad = k_max - batch.mask.shape[1]
        chunks.append(F.pad(group_scores(model, batch, device).cpu(), (0, pad)))
        masks.append(F.pad(batch.mask, (0, pad)))
        if progress is not None:
            progress.advance(len(batch.mask))
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


def micro_losses(
    model: Any,
    parts: list[GroupBatch],
    n_rows: int,
    loss_fn: RewardLossFn,
    params: RewardLossParams,
    device: torch.device,
    out: list[tuple[Tensor, Tensor, Tensor]],
) -> Iterator[Tensor]:
    """Each micro-batch's mean loss weighted by its share of the step's ``n_rows`` groups (the losses add
    up to the batch's mean), one forward pass (all its B*K sequences) when asked; ``out`` collects the
    detached scores, mask and loss of each."""
    for batch in parts:
        scores = group_scores(model, batch, device)
        mask = batch.mask.to(device)
        margins = batch.margins.to(device) if batch.margins is not None else None
        loss = loss_fn(scores, mask, margins, params) * (len(batch.mask) / n_rows)
        out.append((scores.detach(), mask, loss.detach()))
        yield loss


def run_reward_model(
    spec: RewardModelSpec, data: RunData, reporter: Reporter, ctx: LoopContext
) -> LoopResult:
    """Train a scalar reward head (and the LM under it) on ``data``'s pairs or rankings."""
    hp = spec.hyperparameters
    # Resolve, seed, then load: the fresh score head is drawn from the seeded RNG, so it is the same
    # whether or not the preset was already built.
    start = begin(ctx, reporter, spec.model, hp.seed, spec.adapter)
    model, tokenizer = load_trainable(
        start, "score", checkpointing=hp.gradient_checkpointing, precision=hp.precision
    )
    pad_id, device = tokenizer.pad_token_id, start.device

    kind = detect_kind(data.train)
    if data.validation and detect_kind(data.validation) != kind:
        raise ValueError(f"the training rows are {kind} rows but the validation rows are not")
    with reporter.phase("tokenize", len(data.train) + len(data.validation)) as progress:
        groups = tokenize_groups(
            data.train, kind, tokenizer, max_length=hp.max_length, advance=progress.advance
        )
        val_groups = tokenize_groups(
            data.validation, kind, tokenizer, max_length=hp.max_length, advance=progress.advance
        )
    val_groups = [val_groups[i] for i in eval_rows(len(val_groups), hp.eval_max_rows, hp.seed)]
    final_groups = [groups[i] for i in eval_rows(len(groups), hp.eval_max_rows, hp.seed)]
    loss_fn = REWARD_LOSSES[kind]
    params = RewardLossParams(use_margin=hp.use_margin, center_coef=hp.center_coef)
    no_grad_batch = min(EVAL_BATCH_GROUPS, hp.micro_batch_size or hp.batch_size)  # no more than a step's
    session = TrainingSession(start, hp, model, tokenizer, len(groups))
    if session.finished_before:
        return session.result
    if kind == "ranking" and hp.center_coef > 0:
        reporter.event("warning", "center_coef applies to preference pairs only; ignored for rankings")
    reporter.event(
        "info",
        f"training a reward model on {len(groups)} {kind} rows ({len(val_groups)} validation) for "
        f"{hp.max_steps} steps on {device.type}",
    )
    model.train()
    val_scored: Scored | None = None

    def final(progress: Phase) -> Final:  # score statistics of the trained model, stored with it
        if val_scored is not None:
            source, scored = "validation", val_scored
        else:
            source = "train"
            scored = score_groups(model, final_groups, pad_id, device, no_grad_batch, progress)
        stats = reward_stats(scored, source)
        metrics = {
            "final/score_mean": stats["mean"],
            "final/score_std": stats["std"],
            "final/accuracy": float(ranking_stats(scored.scores, scored.mask)["accuracy"]),
        }
        files = {REWARD_STATS_FILE: json.dumps(stats, indent=1)}
        return Final(metrics, files, label="reward model", note=f" (score stats from {source})")

    def evaluate_held_out(progress: Phase) -> dict[str, float]:  # its scores also give the final statistics
        nonlocal val_scored
        val_scored = score_groups(model, val_groups, pad_id, device, no_grad_batch, progress)
        return evaluate(val_scored, loss_fn, params, "eval")

    for _ in session.steps():
        t0 = time.perf_counter()
        rows = [groups[i] for i in session.sampler.next_batch()]
        parts = [collate_groups(list(p), pad_id) for p in session.micro_batches(rows)]
        out: list[tuple[Tensor, Tensor, Tensor]] = []
        grad_norm = session.update(micro_losses(model, parts, len(rows), loss_fn, params, device, out))
        k_max = max(s.shape[1] for s, _, _ in out)
        scores = torch.cat([F.pad(s, (0, k_max - s.shape[1])) for s, _, _ in out])
        mask = torch.cat([F.pad(m, (0, k_max - m.shape[1])) for _, m, _ in out])
        loss = torch.stack([part_loss for _, _, part_loss in out]).sum()
        n_tokens = sum(b.n_tokens for b in parts)
        session.count_tokens(n_tokens)

        metrics: dict[str, float] = {}
        if session.log_due:
            stats = ranking_stats(scores, mask) | {"loss": loss, "grad_norm": grad_norm}
            metrics = session.train_metrics(stats, n_tokens, t0)
        val_scored = None
        metrics |= session.evaluate(val_groups, evaluate_held_out)
        session.end_step(metrics, final)
    return session.result
