"""Which rows a step trains on: epoch-wise shuffled batches, their micro-batches, and the deterministic
hold-out split."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


class EpochSampler:
    """Batches of indices over ``n`` items: a fresh permutation per epoch, wrapping across epochs."""

    def __init__(self, n: int, batch_size: int, generator: torch.Generator):
        if n <= 0:
            raise ValueError("the dataset has no rows")
        self.n, self.batch_size, self.gen = n, batch_size, generator
        self.order: list[int] = []

    def state_dict(self) -> dict[str, object]:
        return {"order": list(self.order), "generator": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.order = list(state["order"])  # type: ignore[call-overload]
        self.gen.set_state(state["generator"])  # type: ignore[arg-type]

    def next_batch(self) -> list[int]:
        batch: list[int] = []
        while len(batch) < self.batch_size:
            if not self.order:
                self.order = torch.randperm(self.n, generator=self.gen).tolist()
            batch.append(self.order.pop())
        return batch


def split_validation(rows: list[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """Deterministic hold-out: ``ceil(n * fraction)`` rows (at least 1) chosen by ``seed``; (train, val)."""
    if fraction <= 0:
        return rows, []
    n_val = max(1, math.ceil(len(rows) * fraction))
    if n_val >= len(rows):
        raise ValueError(f"validation_fraction {fraction} leaves no training rows out of {len(rows)}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    val_idx = set(order[:n_val])
    train = [r for i, r in enumerate(rows) if i not in val_idx]
    val = [r for i, r in enumerate(rows) if i in val_idx]
    return train, val


def micro_batches(rows: Sequence[T], size: int | None) -> list[Sequence[T]]:
    """``rows`` cut into consecutive micro-batches of ``size`` (the last may be smaller); one when None."""
    if size is None or size >= len(rows):
        return [rows]
    return [rows[i : i + size] for i in range(0, len(rows), size)]
