"""Micro-batches of similar length: a batch's rows regrouped so padding costs little.

A padded forward pass costs every row the length of the batch's longest. On real conversations (HH-RLHF
at 512 tokens: rows from 60 to 510 tokens) that is 40% padding, and attention over the padding grows with
the square of the length. A loss that is a sum over rows divided by the batch's size (DPO's, SFT's) gives
the same gradient however the rows are split into micro-batches (the micro-batch losses add up, their
gradients accumulate), so the rows are free to travel in whichever groups cost least.

``group_by_length`` sorts the rows by length and cuts the sorted order into groups, choosing the cuts by
dynamic programming over the cost of a group of ``r`` rows padded to length ``L``::

    cost(r, L) = overhead + r * L * (1 + L / attention_span)

``overhead`` is a pass's fixed cost in tokens' worth of work (kernel launches, Python, small matrices
running below the machine's peak); ``attention_span`` is the length at which a token's attention work
equals its weight matmuls. Counted in FLOPs, a token costs ``2N`` in the matmuls (N parameters) and
``4 L d`` per layer in attention (QK^T and AV over L keys), equal at ``L = N / (2 d n_layers)``; measured on
this machine, attention with a 4D mask runs at about half the matmuls' rate, so ``attention_span_of`` takes
``N / (4 d n_layers)`` (tiny:llama-10m: 1,280 tokens; a fit of the measured 8 x 300-token pass gave
~1,150). With ``equal_runs`` (ranks that must run the same number of passes) the sorted order is cut into
the fewest equal consecutive runs that fit ``max_rows``, ``ceil(n / max_rows)``, instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A forward + backward pass of tiny:llama-10m on this project's 2-core CPU machine costs about 24 ms
# plus 0.38 ms per token (a line through passes of 72 to 512 tokens; bench/dpo_vs_trl.py's docstring),
# i.e. ~64 tokens' worth of fixed cost. On a GPU a pass's fixed cost is worth far more tokens (kernels
# are launched per op whatever the batch); 1024 is a guess, not measured here (no GPU lent).
CPU_PASS_OVERHEAD = 64
GPU_PASS_OVERHEAD = 1024


@dataclass(frozen=True)
class PaddingCost:
    """``cost(r, L)`` of the module docstring."""

    overhead: float
    attention_span: float = float("inf")

    def of(self, rows: int, length: int) -> float:
        return self.overhead + rows * length * (1 + length / self.attention_span)


def attention_span_of(n_parameters: int, hidden_size: int, n_layers: int) -> float:
    """The length at which attention costs a token as much as the weight matmuls (module docstring)."""
    return n_parameters / (4 * hidden_size * n_layers)


def group_by_length(
    lengths: Sequence[int], max_rows: int, cost: PaddingCost, equal_runs: bool = False
) -> list[list[int]]:
    """Indices into ``lengths`` partitioned into groups of at most ``max_rows``, each group a run of the
    length-sorted order (shortest first), cut where ``cost`` summed over the groups is least; with
    ``equal_runs``, into ``ceil(n / max_rows)`` runs whose sizes differ by at most one (a count that
    depends only on ``n``, so ranks holding as many rows run as many passes)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    if n == 0:
        return []
    if equal_runs:
        k = -(-n // max_rows)
        bounds = [n * g // k for g in range(k + 1)]
        return [order[bounds[g] : bounds[g + 1]] for g in range(k)]
    # best[j]: least cost of the first j sorted rows; cut[j]: where the last group of that split starts.
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]  # the longest row of any group ending at j (sorted order)
        for i in range(max(0, j - max_rows), j):
            total = best[i] + cost.of(j - i, longest)
            if total < best[j]:
                best[j], cut[j] = total, i
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]
