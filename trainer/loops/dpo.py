"""DPO run: a policy trained on preference pairs against a frozen reference (Rafailov et al. 2023).

Reads top to bottom: load -> tokenize -> steps (reference log-probs, eval, checkpoints) -> final.
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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.adapters import adapter_off, has_adapter
from trainer.algorithms.logprobs import token_logprobs
from trainer.algorithms.preference_losses import (
    PREFERENCE_LOSSES,
    REFERENCE_FREE_LOSSES,
    PreferenceLossFn,
    PreferenceParams,
    chosen_nll,
    orpo_odds_ratio,
)
from trainer.completion_logps import check_packing, completion_logp_sums, packed_completion_logits
from trainer.data.length_groups import (
    CPU_PASS_OVERHEAD,
    GPU_PASS_OVERHEAD,
    PaddingCost,
    attention_span_of,
    group_by_length,
)
from trainer.data.packing import PackedBatch, pack_sequences
from trainer.data.preference import PairBatch, TokenizedPair, collate_pairs, tokenize_pair
from trainer.data.sampling import micro_batches
from trainer.data.shared_prompt import SharedPromptBatch, collate_shared, shared_attention
from trainer.distributed import (
    Ranks,
    gather_rows,
    is_sharded,
    padded_share,
    share,
    sum_over_ranks,
    unwrap,
)
from trainer.loops.session import Final, TrainingSession, begin, eval_rows, load_policy, to_floats
from trainer.models import load_causal_lm
from trainer.phases import Phase
from trainer.precision import frozen_dtype
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import DpoHyperparameters, DpoSpec, OrpoSpec

# Pairs per no-grad pass (reference log-probs, evaluation) at most; never more than a training
# (micro-)batch, so these passes never need more activation memory than a step.
REFERENCE_BATCH = 16


AnyPairBatch = PairBatch | PackedBatch | SharedPromptBatch
PairCollate = Callable[[list[TokenizedPair]], AnyPairBatch]


def pair_collate(pad_id: int, packing: int | None, shared_prompt: bool = False) -> PairCollate:
    """Pairs -> one batch of their chosen then rejected sequences: padded rows (``collate_pairs``), with
    ``packing`` (a row capacity in tokens) packed rows (trainer/data/packing.py), in the same order, or with
    ``shared_prompt`` one ``prompt | chosen | rejected`` row per pair (trainer/data/shared_prompt.py)."""

    def collate(pairs: list[TokenizedPair]) -> AnyPairBatch:
        if packing is None and shared_prompt:
            return collate_shared(pairs, pad_id)
        if packing is None:
            return collate_pairs(pairs, pad_id)
        seqs = [(p.prompt + p.chosen, len(p.prompt)) for p in pairs]
        seqs += [(p.prompt + p.rejected, len(p.prompt)) for p in pairs]
        return pack_sequences(seqs, packing, pad_id)

    return collate


@dataclass(frozen=True)
class PairGrouping:
    """How a layout's pairs are grouped into passes (trainer/data/length_groups.py): by the length of the
    row(s) a pair takes, at ``cost``; ``None`` for packed rows, which have no padding to save (their
    passes keep the order they come in)."""

    cost: PaddingCost | None
    shared_prompt: bool = False

    def length(self, pair: TokenizedPair) -> int:
        n_p, n_c, n_r = len(pair.prompt), len(pair.chosen), len(pair.rejected)
        return n_p + n_c + n_r if self.shared_prompt else n_p + max(n_c, n_r)

    def groups(
        self, pairs: Sequence[TokenizedPair], max_rows: int, equal_passes: bool = False
    ) -> list[list[int]]:
        """Positions into ``pairs`` in groups of at most ``max_rows``: cut where padding costs least, or
        (``equal_passes``: ranks must run as many passes as each other) ``ceil(n / max_rows)`` groups."""
        if not pairs:
            return []
        if self.cost is None:
            return [list(p) for p in micro_batches(range(len(pairs)), max_rows)]
        return group_by_length([self.length(p) for p in pairs], max_rows, self.cost, equal_passes)


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


def attention_mask_for(model: Any, allowed: Tensor) -> Tensor:
    """A 4D mask in the form the model's attention takes it: boolean for SDPA (True: attend), additive
    float for eager attention (0, or the dtype's minimum where masked)."""
    if getattr(unwrap(model).config, "_attn_implementation", "sdpa") == "eager":
        return torch.zeros(allowed.shape, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min
        )
    return allowed


def shared_prompt_logps(model: Any, batch: SharedPromptBatch, device: torch.device) -> Tensor:
    """``sequence_logps`` of a shared-prompt batch: one forward with the 4D mask and position ids of
    trainer/data/shared_prompt.py, logits only at ``batch.keep``; (2B,) chosen then rejected."""
    allowed = shared_attention(batch.segment.to(device))
    logits = model(
        input_ids=batch.input_ids.to(device),
        attention_mask=attention_mask_for(model, allowed),
        position_ids=batch.position_ids.to(device),
        use_cache=False,
        logits_to_keep=batch.keep.to(device),
    ).logits
    sums = []
    for targets, mask in (
        (batch.chosen_targets, batch.chosen_mask),
        (batch.rejected_targets, batch.rejected_mask),
    ):
        logp = token_logprobs(logits, targets.to(device)).float()
        sums.append((logp * mask.to(device)).sum(-1))
    return torch.cat(sums)


class SharedPromptUnsupported(ValueError):
    """The model's attention does not follow a custom 4D mask (e.g. flash attention)."""


@torch.no_grad()
def check_shared_prompt(model: Any, device: torch.device) -> None:
    """Refuse the shared-prompt layout for a model whose attention ignores a custom 4D mask: a probe pair's
    log-probs must match the padded layout's (two forwards of a few tokens)."""
    was_training = model.training
    model.eval()
    pair = [TokenizedPair(prompt=[1, 2, 3], chosen=[4, 5, 6], rejected=[7, 8])]
    shared = shared_prompt_logps(model, collate_shared(pair, 0), device)
    padded = sequence_logps(model, collate_pairs(pair, 0), device)
    model.train(was_training)
    if not torch.allclose(shared, padded, atol=1e-2, rtol=1e-3):
        raise SharedPromptUnsupported(
            "shared_prompt: this model's attention does not follow a custom 4D mask (the rejected answer "
            f"would see the chosen one; log-probs {shared.tolist()} vs {padded.tolist()} padded)"
        )


def sequence_logps(model: Any, batch: AnyPairBatch, device: torch.device) -> Tensor:
    """(2B,) sum over completion tokens of log pi(y_t | x, y_<t); one forward pass for chosen and rejected,
    logits only where they predict a completion token (``completion_logits``), in the model's dtype (the
    per-token log-probs are summed in float32). A packed batch sums each token into its sequence; a
    shared-prompt batch runs each prompt once (``shared_prompt_logps``)."""
    if isinstance(batch, SharedPromptBatch):
        return shared_prompt_logps(model, batch, device)
    if isinstance(batch, PackedBatch):
        logits, targets, scored, sequence = packed_completion_logits(model, batch, device)
        logp = token_logprobs(logits, targets).float() * scored
        sums = torch.zeros(batch.n_sequences, device=logp.device, dtype=logp.dtype)
        return sums.index_add(0, sequence.clamp(min=0).flatten(), logp.flatten())  # padding adds 0
    return completion_logp_sums(
        model, batch.input_ids.to(device), batch.attention_mask.to(device), batch.completion_mask.to(device)
    )


@torch.no_grad()
def all_pair_logps(
    model: Any,
    pairs: Sequence[TokenizedPair],
    collate: PairCollate,
    batch_size: int,
    device: torch.device,
    progress: Phase | None = None,
    grouping: PairGrouping = PairGrouping(None),
    equal_passes: bool = False,
) -> Tensor:
    """(N, 2) [chosen, rejected] sequence log-probs of every pair, in eval mode; ``progress`` counts pairs.
    Passes of at most ``batch_size`` pairs grouped by ``grouping`` (``equal_passes``: as many as any
    rank with as many pairs runs, for a sharded model); the rows come back in ``pairs``' order."""
    was_training = model.training
    model.eval()
    out = torch.zeros(len(pairs), 2)
    for group in grouping.groups(pairs, batch_size, equal_passes):
        logps = sequence_logps(model, collate([pairs[i] for i in group]), device)
        out[group] = torch.stack([logps[: len(group)], logps[len(group) :]], dim=1).cpu().float()
        if progress is not None:
            progress.advance(len(group))
    model.train(was_training)
    return out


class ReferenceLogps:
    """Reference log-probs [chosen, rejected] of a list of pairs, each computed the first time it is
    asked for (``compute(indices)``, as one ``reference`` phase) and kept. ``state_dict`` / ``load`` carry
    what is known through checkpoints: a value is computed once per run, resumes included."""

    def __init__(self, n: int, compute: Callable[[list[int], Phase], Tensor], reporter: Reporter):
        self.values = torch.zeros(n, 2)
        self.known = torch.zeros(n, dtype=torch.bool)
        self.compute, self.reporter = compute, reporter

    def get(self, idx: Sequence[int]) -> Tensor:
        """(len(idx), 2) values of pairs ``idx``, computing the missing ones now (in ``idx``'s order)."""
        index = torch.as_tensor(list(idx), dtype=torch.long)
        missing = list(dict.fromkeys(i for i in index.tolist() if not self.known[i]))
        if missing:
            with self.reporter.phase("reference", len(missing)) as progress:
                self.values[missing] = self.compute(missing, progress)
            self.known[missing] = True
        return self.values[index]

    def sync(self, ranks: Ranks) -> None:
        """Every rank knows what any rank computed (each computes the pairs of its own share): called by
        every rank of a multi-rank run before a checkpoint, so the one rank 0 writes holds them all."""
        if not ranks.active:
            return
        known = sum_over_ranks(self.known.to(torch.float32), ranks)[:, None]  # (N, 1) ranks knowing it
        values = sum_over_ranks(self.values * self.known[:, None], ranks) / known.clamp(min=1)
        self.values, self.known = values, known[:, 0] > 0

    def state_dict(self) -> dict[str, Tensor]:
        return {"values": self.values, "known": self.known}

    def load(self, state: dict[str, Tensor]) -> None:
        self.values, self.known = state["values"].clone(), state["known"].clone()


def pair_stats(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float) -> dict[str, Tensor]:
    """Implicit rewards r = beta * log(pi/pi_ref) of chosen and rejected, their accuracy and margin."""
    chosen, rejected = beta * chosen_logratio.detach(), beta * rejected_logratio.detach()
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracy": (chosen > rejected).float().mean(),
        "rewards/margin": (chosen - rejected).mean(),
    }


def pair_tokens(pairs: Sequence[TokenizedPair]) -> Tensor:
    """(B, 2) how many tokens of each pair's chosen and rejected answer are scored: all of them after a
    prompt; without a prompt the first has nothing to be predicted from (every layout skips it)."""
    skip = [0 if p.prompt else 1 for p in pairs]
    return torch.tensor(
        [[len(p.chosen) - k, len(p.rejected) - k] for p, k in zip(pairs, skip, strict=True)],
        dtype=torch.float32,
    ).reshape(len(pairs), 2)


@dataclass(frozen=True)
class PairObjective:
    """What a pair costs: the preference loss ``loss_fn`` of its two answers' scores, plus ``rpo_alpha``
    times its chosen answer's per-token NLL (``chosen_nll``; RPO, and ORPO's SFT term) when > 0.

    The scores are log-ratios to the reference (``log pi - log pi_ref``, summed over tokens), or with
    ``length_normalized`` (SimPO, ORPO: no reference) each answer's mean token log-prob."""

    loss_fn: PreferenceLossFn
    params: PreferenceParams
    rpo_alpha: float = 0.0
    length_normalized: bool = False

    def scores(self, chosen: Tensor, rejected: Tensor, ref: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """What ``loss_fn`` reads for pairs with policy log-probs ``chosen``/``rejected`` (B,), reference
        ``ref`` (B, 2) and ``tokens`` (B, 2) scored tokens."""
        if self.length_normalized:
            counts = tokens.to(chosen.device).clamp(min=1.0)
            return chosen / counts[:, 0], rejected / counts[:, 1]
        return chosen - ref[:, 0], rejected - ref[:, 1]

    def per_pair(
        self, chosen: Tensor, rejected: Tensor, ref: Tensor, tokens: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """(B,) losses of the pairs (see ``scores``), and (B,) their chosen NLL per token (None without
        an NLL term)."""
        loss = self.loss_fn(*self.scores(chosen, rejected, ref, tokens), self.params)
        if self.rpo_alpha == 0:
            return loss, None
        nll = chosen_nll(chosen, tokens[:, 0].to(chosen.device))
        return loss + self.rpo_alpha * nll, nll


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


class NoReference:
    """The reference values of a reference-free objective: zeros, never computed, nothing to keep."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get(self, idx: Sequence[int]) -> Tensor:
        return torch.zeros(len(idx), 2)

    def sync(self, ranks: Ranks) -> None:
        pass

    def state_dict(self) -> dict[str, Tensor]:
        return {}

    def load(self, state: dict[str, Tensor]) -> None:
        pass


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
    grouping: PairGrouping = PairGrouping(None),
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


class Reference:
    """The frozen reference model, made or loaded only when a value must be computed: in ``lazy`` mode a
    copy of the starting policy (taken before step 1) or the ``reference_model``; when resuming, loaded
    from the run's start (the resumed checkpoint is not the reference)."""

    def __init__(
        self,
        path: str,
        reporter: Reporter,
        device: torch.device,
        model: Any | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.path, self.reporter, self.device, self.model = path, reporter, device, model
        self.dtype = dtype  # a loaded reference's weights: half under mixed precision (never trained)

    def get(self) -> Any:
        if self.model is None:
            with self.reporter.phase("model_load"):
                self.model, _ = load_causal_lm(self.path, dtype=self.dtype)
                self.model.to(self.device).eval().requires_grad_(False)
        return self.model


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
