"""DPO run: a policy trained on preference pairs against a frozen reference (Rafailov et al. 2023); an
orpo run takes the same loop with a reference-free objective.

Reads top to bottom: objective -> start (the policy, from trainer/loops/session.py) -> tokenize -> session
-> the plan of the pairs' passes (trainer/loops/pair_plan.py) -> the reference side
(trainer/loops/reference.py) -> evaluations -> steps. Each concern has one file: the pair layouts and their
length groups (trainer/data/pair_layout.py), the log-probs a model gives each layout
(trainer/completion_logps.py), the plan a run's pairs follow (layout checked on the model, groups, pass
sizes, evaluation rows), the frozen reference and its cached log-probs, the objective (``PairObjective``,
trainer/algorithms/preference_losses.py) and the scaffold.

The reference never changes, so each pair's reference log-probs are computed once and kept
(``ReferenceLogps``). ``reference_mode`` says when: ``lazy`` (default) computes those of the pairs a step
uses when a step first uses them, from a frozen copy of the reference, so step 1 starts at once on any
dataset size; ``precompute`` computes every pair's before step 1 (TRL's ``precompute_ref_log_probs``) and
keeps no reference in memory while training. The values computed so far travel in each checkpoint, so a
resumed run reads exactly the values an uninterrupted one would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from trainer.algorithms.preference_losses import (
    PREFERENCE_LOSSES,
    REFERENCE_FREE_LOSSES,
    PairObjective,
    PreferenceParams,
    orpo_odds_ratio,
    pair_stats,
)
from trainer.completion_logps import all_pair_logps, sequence_logps
from trainer.data.pair_layout import UNGROUPED, AnyPairBatch, PairCollate, PairGrouping
from trainer.data.preference import TokenizedPair, tokenize_pairs
from trainer.distributed import gather_rows, share, sum_over_ranks
from trainer.loops.pair_plan import REFERENCE_BATCH, pair_plan
from trainer.loops.reference import pair_references
from trainer.loops.session import Final, TrainingSession, begin_policy, to_floats
from trainer.phases import Phase
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import DpoHyperparameters, DpoSpec, OrpoSpec


def pair_objective(spec: DpoSpec | OrpoSpec) -> PairObjective:
    """The objective of a dpo run (its ``loss_type``; simpo reference-free) or an orpo run (the chosen
    NLL plus lambda times the odds-ratio term, reference-free)."""
    hp = spec.hyperparameters
    if isinstance(spec, OrpoSpec):
        return PairObjective(orpo_odds_ratio, PreferenceParams(beta=hp.beta), 1.0, length_normalized=True)
    assert isinstance(hp, DpoHyperparameters)
    return PairObjective(
        PREFERENCE_LOSSES[hp.loss_type],
        PreferenceParams(beta=hp.beta, label_smoothing=hp.label_smoothing, gamma=hp.gamma),
        hp.rpo_alpha,
        length_normalized=hp.loss_type in REFERENCE_FREE_LOSSES,
    )


def evaluate(
    model: Any,
    pairs: Sequence[TokenizedPair],
    ref: Tensor,
    tokens: Tensor,
    collate: PairCollate,
    device: torch.device,
    objective: PairObjective,
    prefix: str,
    progress: Phase | None = None,
    batch_size: int = REFERENCE_BATCH,
    grouping: PairGrouping = UNGROUPED,
    equal_passes: bool = False,
) -> dict[str, float]:
    """``<prefix>/*`` metrics over ``pairs`` (reference log-probs ``ref``, scored tokens ``tokens``) with
    the current policy."""
    logps = all_pair_logps(model, pairs, collate, batch_size, device, progress, grouping, equal_passes)
    chosen_score, rejected_score = objective.scores(logps[:, 0], logps[:, 1], ref, tokens)
    stats = pair_stats(chosen_score, rejected_score, objective.params.beta)
    loss, nll = objective.per_pair(logps[:, 0], logps[:, 1], ref, tokens)
    stats["loss"] = loss.mean()
    if nll is not None:
        stats["nll/chosen"] = nll.mean()
    return {f"{prefix}/{k}": v for k, v in to_floats(stats).items()}


def micro_losses(
    model: Any,
    parts: list[tuple[list[int], AnyPairBatch]],
    ref: Tensor,
    tokens: Tensor,
    objective: PairObjective,
    device: torch.device,
    out: dict[str, list[Tensor]],
    total: int,
) -> Iterator[Tensor]:
    """For each micro-batch (the rows of ``ref`` and ``tokens`` its pairs are, and its batch) the sum of
    its pairs' losses over the whole batch's ``total`` pairs (a rank of a multi-rank run holds a share of
    the batch): the micro-batch losses add up to the batch's mean loss, in whatever groups the pairs
    travel. One forward pass when asked; ``out`` collects the rows, the detached chosen and rejected
    log-probs (and chosen NLL with RPO) and each micro-batch loss."""
    for rows, batch in parts:
        logps = sequence_logps(model, batch, device)
        chosen, rejected = logps[: len(rows)], logps[len(rows) :]
        per_pair, nll = objective.per_pair(chosen, rejected, ref[rows], tokens[rows])
        loss = per_pair.sum() / total
        out.setdefault("rows", []).append(torch.as_tensor(rows, dtype=torch.long))
        out.setdefault("chosen", []).append(chosen.detach())
        out.setdefault("rejected", []).append(rejected.detach())
        if nll is not None:
            out.setdefault("nll", []).append(nll.detach())
        out.setdefault("loss", []).append(loss.detach())
        yield loss


def in_row_order(out: dict[str, list[Tensor]], key: str) -> Tensor:
    """``out[key]``'s values (collected group by group by ``micro_losses``) put back in row order."""
    rows, values = torch.cat(out["rows"]), torch.cat(out[key])
    ordered = torch.empty_like(values)
    ordered[rows.to(values.device)] = values
    return ordered


def run_dpo(spec: DpoSpec | OrpoSpec, data: RunData, reporter: Reporter, ctx: LoopContext) -> LoopResult:
    """Train ``spec.model`` with the preference loss ``spec.hyperparameters.loss_type`` (a dpo run) or
    ORPO's (an orpo run). Reference-free objectives (simpo, orpo) load no reference model."""
    hp, ranks = spec.hyperparameters, ctx.ranks
    objective = pair_objective(spec)
    reference_model = spec.reference_model if isinstance(spec, DpoSpec) else None
    same_reference = reference_model is None or reference_model == spec.model
    ref_path = ctx.resolve_model(reference_model or spec.model)  # before seeding, as ``begin`` says
    start, model, tokenizer = begin_policy(ctx, reporter, spec.model, hp, spec.adapter)
    device = start.device
    with reporter.phase("tokenize", len(data.train) + len(data.validation)) as progress:
        lengths = {"max_length": hp.max_length, "max_prompt_length": hp.max_prompt_length}
        pairs = tokenize_pairs(data.train, tokenizer, **lengths, progress=progress)
        val_pairs = tokenize_pairs(data.validation, tokenizer, **lengths, progress=progress)
    session = TrainingSession(start, hp, model, tokenizer, len(pairs))
    if session.finished_before:
        return session.result
    plan = pair_plan(model, device, tokenizer.pad_token_id, hp, pairs, val_pairs, reporter, ranks)
    reference_free = objective.length_normalized
    refs = pair_references(session, ref_path, same_reference, reference_free, pairs, val_pairs, plan)
    held_out = [val_pairs[i] for i in plan.val_idx]
    how = (
        "no reference model (length-normalised likelihoods)"
        if reference_free
        else f"reference log-probs: {hp.reference_mode if isinstance(hp, DpoHyperparameters) else 'lazy'}"
    )
    reporter.event(
        "info",
        f"training on {len(pairs)} pairs ({len(val_pairs)} validation) for "
        f"{hp.max_steps} steps on {device.type}; {how}",
    )
    model.train()
    collate, grouping = plan.collate, plan.grouping

    def final(progress: Phase) -> Final:  # training pairs (up to eval_max_rows), with the trained policy
        return Final(
            evaluate(
                model,
                [pairs[i] for i in plan.final_idx],
                refs.train.get(plan.final_idx),
                plan.tokens[plan.final_idx],
                collate,
                device,
                objective,
                "final",
                progress,
                plan.no_grad_batch,
                grouping,
                plan.equal_passes,
            )
        )

    def evaluate_held_out(progress: Phase) -> dict[str, float]:
        return evaluate(
            model,
            held_out,
            refs.validation.get(plan.val_idx),
            plan.val_tokens[plan.val_idx],
            collate,
            device,
            objective,
            "eval",
            progress,
            plan.no_grad_batch,
            grouping,
            plan.equal_passes,
        )

    for _ in session.steps():
        t0 = time.perf_counter()
        idx = session.sampler.next_batch()  # the global batch: the same on every rank
        mine = share(idx, ranks)  # this rank's part of it (all of it on one rank)
        # Every rank reads the whole batch's reference values, so all know the same pairs and compute the
        # same missing ones: the same number of passes on each, as a sharded reference needs.
        ref_batch = refs.train.get(idx).to(device)
        first = ranks.rank * len(mine)
        ref_mine = ref_batch[first : first + len(mine)]
        mine_pairs = [pairs[i] for i in mine]
        groups = grouping.groups(mine_pairs, plan.max_rows, equal_passes=plan.equal_passes)
        parts = [(g, collate([mine_pairs[q] for q in g])) for g in groups]
        out: dict[str, list[Tensor]] = {}
        tokens = plan.tokens[mine]
        grad_norm = session.update(
            micro_losses(model, parts, ref_mine, tokens, objective, device, out, total=len(idx))
        )
        chosen = gather_rows(in_row_order(out, "chosen"), ranks)  # every rank's, in batch order
        rejected = gather_rows(in_row_order(out, "rejected"), ranks)
        batch_tokens = plan.tokens[idx].to(device)
        chosen_logratio, rejected_logratio = objective.scores(chosen, rejected, ref_batch, batch_tokens)
        loss = sum_over_ranks(torch.stack(out["loss"]).sum(), ranks)
        n_tokens = int(sum_over_ranks(torch.tensor(sum(b.n_tokens for _, b in parts)), ranks))
        session.count_tokens(n_tokens)

        metrics: dict[str, float] = {}
        if session.log_due:
            stats = pair_stats(chosen_logratio, rejected_logratio, objective.params.beta)
            stats |= {
                "loss": loss,
                "grad_norm": grad_norm,
                "logps/chosen": chosen.mean(),
                "logps/rejected": rejected.mean(),
            }
            if "nll" in out:
                stats["nll/chosen"] = gather_rows(in_row_order(out, "nll"), ranks).mean()
            metrics = session.train_metrics(stats, n_tokens, t0)
        metrics |= session.evaluate(held_out, evaluate_held_out)
        session.end_step(metrics, final)
    return session.result
