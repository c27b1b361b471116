"""Padding-free packing: a batch's sequences laid end to end in as few rows as fit, not one padded row each.

A padded batch of sequences with very different lengths (chat data: a 40-token answer beside a 500-token
one) spends most of its compute and activation memory on padding. Packed, the sequences go into rows of
at most ``capacity`` tokens (first-fit decreasing, Johnson 1973: at most 11/9 OPT + 6/9 rows), each
sequence's position ids restart at 0, and no attention mask is passed: transformers then reads the
sequence boundaries from the position ids and builds a block-diagonal causal mask (sdpa/eager; varlen
kernels for flash attention), so no token attends across a boundary and every sequence's logits equal
its logits alone. The only padding left is each row's tail after its last sequence.

A sequence's first token is never scored (nothing in the same sequence predicts it), so the label shift
never reads across a boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PackedBatch:
    """Rows of packed sequences, all (R, T), right-padded.

    ``position_ids`` restart at 0 at each sequence (the padding tail counts from 0 too, as a sequence of
    its own); ``scored`` is True on the completion tokens a loss reads; ``sequence`` is the index of the
    input sequence a token belongs to, -1 on padding.
    """

    input_ids: Tensor
    position_ids: Tensor
    scored: Tensor
    sequence: Tensor
    n_sequences: int

    @property
    def n_tokens(self) -> int:
        return int((self.sequence >= 0).sum())

    @property
    def n_scored(self) -> int:
        return int(self.scored.sum())


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of total length at most ``capacity``: longest first,
    each into the first bin with room (ties keep input order, so the packing is deterministic). A length
    above ``capacity`` gets a bin of its own."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack_sequences(sequences: Sequence[tuple[Sequence[int], int]], capacity: int, pad_id: int) -> PackedBatch:
    """Pack ``(tokens, completion_start)`` sequences (tokens from ``completion_start`` on are scored,
    never token 0) into rows of at most ``max(capacity, longest)`` tokens."""
    lengths = [len(tokens) for tokens, _ in sequences]
    rows = first_fit_decreasing(lengths, max([capacity, *lengths]))
    width = max((sum(lengths[i] for i in row) for row in rows), default=1)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    scored = torch.zeros((len(rows), width), dtype=torch.bool)
    seq = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            tokens, start = sequences[i]
            n = len(tokens)
            ids[r, at : at + n] = torch.as_tensor(list(tokens), dtype=torch.long)
            pos[r, at : at + n] = torch.arange(n)
            scored[r, at + max(start, 1) : at + n] = True
            seq[r, at : at + n] = i
            at += n
        pos[r, at:] = torch.arange(width - at)  # the padding tail: a separate run of positions
    return PackedBatch(ids, pos, scored, seq, len(sequences))
