"""The frozen reference of a preference run (DPO, KTO): the model, made or loaded only when a value must be
computed, and the reference log-probs of a run's pairs, each computed once and kept through checkpoints
(``ReferenceLogps``); ``NoReference`` stands in for a reference-free objective. ``pair_references`` builds
the whole reference side of a pair run (dpo, orpo) in one call."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.adapters import adapter_off, has_adapter
from trainer.completion_logps import all_pair_logps
from trainer.data.preference import TokenizedPair
from trainer.distributed import Ranks, is_sharded, padded_share, sum_over_ranks, unwrap
from trainer.loops.pair_plan import PairPlan
from trainer.loops.session import TrainingSession
from trainer.models import load_causal_lm
from trainer.phases import Phase
from trainer.precision import frozen_dtype
from trainer.reporting import Reporter
from trainer.specs import DpoHyperparameters


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


@dataclass(frozen=True)
class PairReferences:
    """The reference log-probs of a pair run's training and validation pairs, and the ranks that share
    them."""

    train: ReferenceLogps | NoReference
    validation: ReferenceLogps | NoReference
    ranks: Ranks

    def extra_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of them: every rank's values (``sync``), known or not."""
        self.train.sync(self.ranks)
        self.validation.sync(self.ranks)
        return {"ref_logps": {"train": self.train.state_dict(), "validation": self.validation.state_dict()}}


def pair_references(
    session: TrainingSession,
    ref_path: str,
    same_reference: bool,
    reference_free: bool,
    pairs: Sequence[TokenizedPair],
    val_pairs: Sequence[TokenizedPair],
    plan: PairPlan,
) -> PairReferences:
    """The reference side of a pair run (dpo, orpo) whose policy is ``session.model``: its frozen reference
    (``Reference``) and the reference log-probs of its pairs, the values a resumed checkpoint kept loaded,
    kept in every checkpoint from now on (``session.extra_state``), and with ``reference_mode:
    precompute`` all computed now. ``reference_free`` (simpo, orpo): zeros, no reference at all.

    The reference is the starting policy itself before step 1 (precompute), a frozen copy of it (lazy), or
    the ``reference_model`` at ``ref_path``; after a resume, loaded from the start only if a value is still
    missing. With an adapter it is the policy with its adapter off (the start: no copy at all)."""
    hp, model, device, ranks = session.hp, session.model, session.device, session.ranks
    reporter = session.reporter
    fresh_start = not session.resumed and same_reference
    precompute = (
        isinstance(hp, DpoHyperparameters) and hp.reference_mode == "precompute" and not reference_free
    )
    reference = Reference(
        ref_path,
        reporter,
        device,
        model if precompute and fresh_start else None,
        dtype=frozen_dtype(hp.precision, device),
    )
    if reference_free:
        pass  # nothing to copy or load: the objective reads the policy alone
    elif same_reference and has_adapter(unwrap(model)):
        reference.model = model
    elif not precompute and fresh_start and not is_sharded(model):  # a sharded one loads its own copy
        reference.model = copy.deepcopy(unwrap(model)).to(reference.dtype).eval().requires_grad_(False)

    def computer(rows: Sequence[TokenizedPair]) -> Callable[[list[int], Phase], Tensor]:
        def compute(idx: list[int], progress: Phase) -> Tensor:
            ref_model = reference.get()
            with adapter_off(unwrap(ref_model)):
                return all_pair_logps(
                    ref_model,
                    [rows[i] for i in idx],
                    plan.collate,
                    plan.no_grad_batch,
                    device,
                    progress,
                    plan.grouping,
                    plan.equal_passes,
                )

        return compute

    if reference_free:
        refs = PairReferences(NoReference(len(pairs)), NoReference(len(val_pairs)), ranks)
    else:
        refs = PairReferences(
            ReferenceLogps(len(pairs), computer(pairs), reporter),
            ReferenceLogps(len(val_pairs), computer(val_pairs), reporter),
            ranks,
        )
    saved = None if reference_free else session.extra.get("ref_logps")
    if isinstance(saved, tuple):  # a checkpoint written before reference_mode: every value precomputed
        saved = {
            key: {"values": v, "known": torch.ones(len(v), dtype=torch.bool)}
            for key, v in zip(("train", "validation"), saved, strict=True)
        }
    if saved is not None:
        refs.train.load(saved["train"])
        refs.validation.load(saved["validation"])
    session.extra_state = refs.extra_state
    if precompute:  # each rank its share (padded to equal passes), then every rank knows them all
        refs.train.get(padded_share(len(pairs), ranks))
        refs.train.sync(ranks)
        refs.validation.get(plan.val_idx)
        reference.model = None  # not needed again: every value a step or an evaluation reads is known
    return refs
