"""Sampling whose draws belong to a row, not to a batch: each row of a ``generate`` call has its own random
stream, seeded from the call's seed and the row's *global* index, so a prompt's samples are the same
whether it is generated alone, in a chunk of 64, or on rank 1 of 2 with half of the step's prompts.

``generate``'s own sampling draws every row's token from one ``torch.multinomial`` over the whole batch:
what a row gets depends on the batch it sits in, so splitting a step's prompts over ranks (or changing the
engine's chunk size) changed the samples. Here decoding is greedy over noised logits (the exponential race,
equivalently the Gumbel-max trick, Gumbel 1954; Maddison et al. 2014):

    x_t = argmax_v  p_v / q_v,   q_v ~ Exp(1) i.i.d.      (= argmax_v  log p_v - log q_v)

which draws ``x_t`` from ``p`` exactly: ``P(p_v / q_v is the largest) = p_v / sum_u p_u``. ``p`` is the
tempered, top-k / top-p truncated distribution, built by transformers' own warpers in its own order; the
``q`` of row ``r`` come from ``torch.Generator(seed=row_seed(seed, r))``, one ``Exp(1)`` vector per decoding
step. vLLM's sampler draws seeded requests the same way (a generator per request, ``probs / q``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainer.rollout.base import SamplingParams

_MASK64 = (1 << 64) - 1


def row_seed(seed: int, row: int) -> int:
    """The seed of global row ``row``'s stream in a call seeded ``seed``: splitmix64 (Steele et al. 2014)
    of the pair, so nearby seeds and rows give unrelated streams. A non-negative int below 2**63."""
    z = (seed * 0x9E3779B97F4A7C15 + row + 1) & _MASK64
    for _ in range(2):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z = z ^ (z >> 31)
    return z >> 1


class RowNoise:
    """A transformers logits processor that adds ``-log q`` (``q ~ Exp(1)``, one vector per row and step,
    from the row's own generator) to the scores; greedy decoding after it samples (module docstring).

    Args:
        seeds: one stream seed per row of the batch, in row order (``row_seed``).
        device: where the scores are (generators live on the same device).
    """

    def __init__(self, seeds: list[int], device: torch.device):
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"{scores.shape[0]} rows of scores for {len(self.generators)} row streams")
        q = torch.empty_like(scores, dtype=torch.float32)
        for row, gen in enumerate(self.generators):  # every row draws at every step: its stream's n-th
            q[row].exponential_(generator=gen)  # vector is always its n-th token's, whatever the batch
        return scores - q.log().to(scores.dtype)


def row_processors(params: SamplingParams, rows: Sequence[int], device: torch.device) -> list[Any]:
    """The processors that turn greedy decoding of the rows ``rows`` (global indices) into sampling from
    ``params``' distribution: transformers' temperature, top-k and top-p warpers (its sampling order), then
    ``RowNoise``. Without ``params.seed`` the streams are seeded from torch's global RNG (one draw)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
    warpers: list[Any] = []
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return [*warpers, RowNoise([row_seed(seed, r) for r in rows], device)]
