"""The frozen reference of a preference run (DPO, KTO): the model, made or loaded only when a value must be
computed, and the reference log-probs of a run's pairs, each computed once and kept through checkpoints
(``ReferenceLogps``); ``NoReference`` stands in for a reference-free objective."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from trainer.distributed import Ranks, sum_over_ranks
from trainer.models import load_causal_lm
from trainer.phases import Phase
from trainer.reporting import Reporter


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
