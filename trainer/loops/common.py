"""Small helpers shared by the loops: seeding, devices, schedules, timing."""

from __future__ import annotations

import random

import torch


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python and torch; return a generator for data order so sampling never shifts init RNG."""
    random.seed(seed)
    torch.manual_seed(seed)
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def warmup_constant_lr(step: int, *, base_lr: float, warmup_steps: int) -> float:
    """Linear warmup from 0 to ``base_lr`` over ``warmup_steps`` (1-based step), then constant."""
    if warmup_steps <= 0 or step > warmup_steps:
        return base_lr
    return base_lr * step / warmup_steps


class EpochSampler:
    """Batches of indices over ``n`` items: a fresh permutation per epoch, wrapping across epochs."""

    def __init__(self, n: int, batch_size: int, generator: torch.Generator):
        if n <= 0:
            raise ValueError("the dataset has no rows")
        self.n, self.batch_size, self.gen = n, batch_size, generator
        self.order: list[int] = []

    def next_batch(self) -> list[int]:
        batch: list[int] = []
        while len(batch) < self.batch_size:
            if not self.order:
                self.order = torch.randperm(self.n, generator=self.gen).tolist()
            batch.append(self.order.pop())
        return batch
