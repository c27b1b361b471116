"""A process's place in a multi-rank run, torch-free: the worker and the loop context name it before any run
has loaded torch (trainer/distributed.py holds what the ranks do together)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Sharding = Literal["ddp", "fsdp"]


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: its rank, how many ranks, how the model is spread over them."""

    rank: int = 0
    world: int = 1
    sharding: Sharding = "ddp"

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1
