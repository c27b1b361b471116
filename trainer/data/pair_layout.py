"""How a batch of preference pairs is laid out for a forward pass: padded rows (chosen then rejected),
packed rows, or one ``prompt | chosen | rejected`` row per pair; how pairs are grouped into passes by
length; and how many tokens of each answer are scored. Tokens only: the model's side is
trainer/completion_logps.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.data.length_groups import PaddingCost, group_by_length
from trainer.data.packing import PackedBatch, pack_sequences
from trainer.data.preference import PairBatch, TokenizedPair, collate_pairs
from trainer.data.sampling import micro_batches
from trainer.data.shared_prompt import SharedPromptBatch, collate_shared

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


UNGROUPED = PairGrouping(None)  # passes in the order the pairs come, at most so many pairs each


def pair_tokens(pairs: Sequence[TokenizedPair]) -> Tensor:
    """(B, 2) how many tokens of each pair's chosen and rejected answer are scored: all of them after a
    prompt; without a prompt the first has nothing to be predicted from (every layout skips it)."""
    skip = [0 if p.prompt else 1 for p in pairs]
    return torch.tensor(
        [[len(p.chosen) - k, len(p.rejected) - k] for p, k in zip(pairs, skip, strict=True)],
        dtype=torch.float32,
    ).reshape(len(pairs), 2)
