"""DPO run: a policy trained on preference pairs against a frozen reference (Rafailov et al. 2023); an
orpo run takes the same loop with a reference-free objective.

Reads top to bottom: objective -> load -> tokenize -> reference -> layout -> steps (reference log-probs,
eval, checkpoints) -> final. Each concern it calls on has one file: the pair layouts and their length
groups (trainer/data/pair_layout.py), the log-probs a model gives each layout (trainer/completion_logps.py),
the frozen reference and its cached log-probs (trainer/loops/reference.py), the objective
(``PairObjective``, trainer/algorithms/preference_losses.py) and the scaffold (trainer/loops/session.py).

The reference never changes, so each pair's reference log-probs are computed once and kept
(``ReferenceLogps``). ``reference_mode`` says when: ``lazy`` (default) computes those of the pairs a step
uses when a step first uses them, from a frozen copy of the reference, so step 1 starts at once on any
dataset size; ``precompute`` computes every pair's before step 1 (TRL's ``precompute_ref_log_probs``) and
keeps no reference in memory while training. The values computed so far travel in each checkpoint, so a
resumed run reads exactly the values an uninterrupted one would.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from trainer.adapters import adapter_off, has_adapter
from trainer.algorithms.preference_losses import (
    PREFERENCE_LOSSES,
    REFERENCE_FREE_LOSSES,
    PairObjective,
    PreferenceParams,
    orpo_odds_ratio,
    pair_stats,
)
from trainer.completion_logps import (
    SharedPromptUnsupported,
    all_pair_logps,
    check_packing,
    check_shared_prompt,
    sequence_logps,
)
from trainer.data.length_groups import CPU_PASS_OVERHEAD, GPU_PASS_OVERHEAD, PaddingCost, attention_span_of
from trainer.data.pair_layout import (
    UNGROUPED,
    AnyPairBatch,
    PairCollate,
    PairGrouping,
    pair_collate,
    pair_tokens,
)
from trainer.data.preference import TokenizedPair, tokenize_pair
from trainer.distributed import gather_rows, is_sharded, padded_share, share, sum_over_ranks, unwrap
from trainer.loops.reference import NoReference, Reference, ReferenceLogps
from trainer.loops.session import Final, TrainingSession, begin, eval_rows, load_policy, to_floats
from trainer.models import load_causal_lm  # noqa: F401 - bench/dpo_vs_trl.py patches this name here
from trainer.phases import Phase
from trainer.precision import frozen_dtype
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import DpoHyperparameters, DpoSpec, OrpoSpec

# Pairs per no-grad pass (reference log-probs, evaluation) at most; never more than a training
# (micro-)batch, so these passes never need more activation memory than a step.
REFERENCE_BATCH = 16


def pair_grouping(model: Any, device: torch.device, packing: bool, shared_prompt: bool) -> PairGrouping:
    """The grouping of a run's layout on ``device``: a pass's fixed cost measured on CPU (a guess on GPU),
    attention's cost from the model's shape. A padded pair is two rows (chosen, rejected): half the
    overhead per row keeps ``cost.of(rows, L)`` the cost of that many pairs."""
    if packing:
        return PairGrouping(None)
    config = unwrap(model).config
    config = getattr(config, "get_text_config", lambda: config)()
    n_parameters = sum(p.numel() for p in unwrap(model).parameters())
    span = attention_span_of(n_parameters, config.hidden_size, config.num_hidden_layers)
    overhead = GPU_PASS_OVERHEAD if device.type == "cuda" else CPU_PASS_OVERHEAD
    return PairGrouping(PaddingCost(overhead if shared_prompt else overhead / 2, span), shared_prompt)


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
    collate: PairCollate,
    device: torch.device,
    objective: PairObjective,
    prefix: str,
    progress: Phase | None = None,
    batch_size: int = REFERENCE_BATCH,
    grouping: PairGrouping = UNGROUPED,
    equal_passes: bool = False,
) -> dict[str, float]:
    """``<prefix>/*`` metrics over ``pairs`` (reference log-probs ``ref``) with the current policy."""
    logps = all_pair_logps(model, pairs, collate, batch_size, device, progress, grouping, equal_passes)
    tokens = pair_tokens(pairs)
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
    start = begin(ctx, reporter, spec.model, hp.seed, spec.adapter)
    model, tokenizer = load_policy(start, hp)
    pad_id, device = tokenizer.pad_token_id, start.device

    with reporter.phase("tokenize", len(data.train) + len(data.validation)) as progress:

        def tokenize(rows: list[dict[str, Any]]) -> list[TokenizedPair]:
            out = []
            for r in rows:
                out.append(
                    tokenize_pair(
                        r, tokenizer, max_length=hp.max_length, max_prompt_length=hp.max_prompt_length
                    )
                )
                progress.advance()
            return out

        pairs, val_pairs = tokenize(data.train), tokenize(data.validation)
    session = TrainingSession(start, hp, model, tokenizer, len(pairs))
    if session.finished_before:
        return session.result

    # The reference: the starting policy itself before step 1 (precompute), a frozen copy of it (lazy), or
    # the reference_model; after a resume, loaded from the start only if a value is still missing.
    # With an adapter the reference is the policy with its adapter off (the start: no copy at all).
    fresh_start = not session.resumed and same_reference
    reference_free = objective.length_normalized
    precompute = (
        isinstance(hp, DpoHyperparameters) and hp.reference_mode == "precompute" and not reference_free
    )
    reference = Reference(
        ref_path,
        reporter,
        device,
        model if precompute and fresh_start else None,
        dtype=frozen_dtype(hp.precision),
    )
    if reference_free:
        pass  # nothing to copy or load: the objective reads the policy alone
    elif same_reference and has_adapter(unwrap(model)):
        reference.model = model
    elif not precompute and fresh_start and not is_sharded(model):  # a sharded one loads its own copy
        reference.model = copy.deepcopy(unwrap(model)).to(reference.dtype).eval().requires_grad_(False)

    no_grad_batch = min(REFERENCE_BATCH, hp.micro_batch_size or hp.batch_size)
    shared_prompt = hp.shared_prompt and not hp.packing
    if shared_prompt:
        try:
            check_shared_prompt(model, device)
        except SharedPromptUnsupported as exc:
            shared_prompt = False
            reporter.event("warning", f"{exc}; using the padded layout (the same values, slower)")
    collate = pair_collate(pad_id, hp.max_length if hp.packing else None, shared_prompt)
    if hp.packing:
        check_packing(model, device)
    # Pairs travel in groups of similar length (trainer/data/length_groups.py): the same losses and
    # gradients, less padding. Ranks whose pairs differ run as many passes as each other.
    grouping = pair_grouping(model, device, bool(hp.packing), shared_prompt)
    max_rows = hp.micro_batch_size or hp.batch_size

    def computer(rows: list[TokenizedPair]) -> Callable[[list[int], Phase], Tensor]:
        def compute(idx: list[int], progress: Phase) -> Tensor:
            ref_model = reference.get()
            with adapter_off(unwrap(ref_model)):
                return all_pair_logps(
                    ref_model,
                    [rows[i] for i in idx],
                    collate,
                    no_grad_batch,
                    device,
                    progress,
                    grouping,
                    ranks.active,
                )

        return compute

    ref: ReferenceLogps | NoReference = ReferenceLogps(len(pairs), computer(pairs), reporter)
    val_ref: ReferenceLogps | NoReference = ReferenceLogps(len(val_pairs), computer(val_pairs), reporter)
    if reference_free:
        ref, val_ref = NoReference(len(pairs)), NoReference(len(val_pairs))
    saved = None if reference_free else session.extra.get("ref_logps")
    if isinstance(saved, tuple):  # a checkpoint written before reference_mode: every value precomputed
        saved = {
            key: {"values": v, "known": torch.ones(len(v), dtype=torch.bool)}
            for key, v in zip(("train", "validation"), saved, strict=True)
        }
    if saved is not None:
        ref.load(saved["train"])
        val_ref.load(saved["validation"])

    def extra_state() -> dict[str, Any]:
        ref.sync(ranks)
        val_ref.sync(ranks)
        return {"ref_logps": {"train": ref.state_dict(), "validation": val_ref.state_dict()}}

    session.extra_state = extra_state
    val_idx = eval_rows(len(val_pairs), hp.eval_max_rows, hp.seed)
    final_idx = eval_rows(len(pairs), hp.eval_max_rows, hp.seed)
    held_out = [val_pairs[i] for i in val_idx]
    if precompute:  # each rank its share (padded to equal passes), then every rank knows them all
        ref.get(padded_share(len(pairs), ranks))
        ref.sync(ranks)
        val_ref.get(val_idx)
        reference.model = None  # not needed again: every value a step or an evaluation reads is known
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

    def final(progress: Phase) -> Final:  # training pairs (up to eval_max_rows), with the trained policy
        rows = [pairs[i] for i in final_idx]
        return Final(
            evaluate(
                model,
                rows,
                ref.get(final_idx),
                collate,
                device,
                objective,
                "final",
                progress,
                no_grad_batch,
                grouping,
                ranks.active,
            )
        )

    def evaluate_held_out(progress: Phase) -> dict[str, float]:
        return evaluate(
            model,
            held_out,
            val_ref.get(val_idx),
            collate,
            device,
            objective,
            "eval",
            progress,
            no_grad_batch,
            grouping,
            ranks.active,
        )

    for _ in session.steps():
        t0 = time.perf_counter()
        idx = session.sampler.next_batch()  # the global batch: the same on every rank
        mine = share(idx, ranks)  # this rank's part of it (all of it on one rank)
        # Every rank reads the whole batch's reference values, so all know the same pairs and compute the
        # same missing ones: the same number of passes on each, as a sharded reference needs.
        ref_batch = ref.get(idx).to(device)
        first = ranks.rank * len(mine)
        ref_mine = ref_batch[first : first + len(mine)]
        mine_pairs = [pairs[i] for i in mine]
        groups = grouping.groups(mine_pairs, max_rows, equal_passes=ranks.active)
        parts = [(g, collate([mine_pairs[q] for q in g])) for g in groups]
        out: dict[str, list[Tensor]] = {}
        tokens = pair_tokens(mine_pairs)
        grad_norm = session.update(
            micro_losses(model, parts, ref_mine, tokens, objective, device, out, total=len(idx))
        )
        chosen = gather_rows(in_row_order(out, "chosen"), ranks)  # every rank's, in batch order
        rejected = gather_rows(in_row_order(out, "rejected"), ranks)
        batch_tokens = pair_tokens([pairs[i] for i in idx]).to(device)
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
