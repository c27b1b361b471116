"""Reduce a per-token loss (B, T) to a scalar, and masked statistics helpers.

Every mode has the call shape ``fn(per_token, mask, *, normaliser, max_len) -> 0-dim tensor``;
``aggregate(per_token, mask, mode, ...)`` dispatches through ``AGGREGATIONS``.

Gradient accumulation. With the default (local) denominators, averaging micro-batch losses is *not* the
full-batch loss when micro-batches hold different numbers of tokens (or non-empty rows). Pass
``normaliser`` = ``batch_normaliser(mask, mode)`` of the whole batch (its valid tokens for
``token_mean``; its rows with at least one valid token for ``seq_mean_token_mean`` and
``seq_mean_token_sum``; all its rows, B, for ``seq_mean_token_sum_norm``) to every micro-batch and *sum*
the micro-batch losses: the accumulated gradient then equals the full-batch gradient exactly (tested to
1e-6, fully masked rows included).

Masked positions contribute 0 through ``torch.where``, so a NaN or inf in a padded position cannot reach
the value (its upstream gradient may still be NaN if the op that produced it has an infinite derivative).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

import torch
from torch import Tensor

from trainer.algorithms._registry import lookup


class AggregationFn(Protocol):
    """Registry call shape of the aggregation modes."""

    def __call__(
        self, per_token: Tensor, mask: Tensor, *, normaliser: Tensor | float | None, max_len: int | None
    ) -> Tensor:
        """Reduce (B, T) to a 0-dim tensor."""
        ...


def _masked(per_token: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    valid = mask.to(torch.bool)
    return torch.where(valid, per_token, torch.zeros_like(per_token)), valid


def _nonempty_rows(valid: Tensor, dtype: torch.dtype) -> Tensor:
    return valid.any(dim=-1).sum().to(dtype).clamp(min=1)


def token_mean(
    per_token: Tensor, mask: Tensor, *, normaliser: Tensor | float | None, max_len: int | None
) -> Tensor:
    """Mean over all valid tokens of the batch: every token weighs the same.

    Args:
        per_token: (B, T) loss.
        mask: (B, T) bool/0-1.
        normaliser: denominator; None = number of valid tokens here (at least 1). For gradient
            accumulation pass the minibatch's total valid tokens and sum the micro-batch results.
        max_len: unused.

    Returns:
        0-dim loss.

    Formula: ``sum_{b,t} m_bt x_bt / N``, N = normaliser or ``sum m``.
    Source: verl ``agg_loss`` "token-mean"; DAPO (Yu et al. 2025), token-level policy gradient loss.
    Degenerate: a fully masked batch gives 0, no NaN.
    """
    del max_len
    x, valid = _masked(per_token, mask)
    denom = valid.sum().to(x.dtype).clamp(min=1) if normaliser is None else normaliser
    return x.sum() / denom


def seq_mean_token_mean(
    per_token: Tensor, mask: Tensor, *, normaliser: Tensor | float | None, max_len: int | None
) -> Tensor:
    """Mean over sequences of each sequence's token mean: every sequence weighs the same (GRPO).

    Args:
        per_token: (B, T) loss.
        mask: (B, T) bool/0-1.
        normaliser: N; None = rows with at least one valid token here (at least 1), which is what a
            micro-batch must be given for the whole batch (``batch_normaliser``).
        max_len: unused.

    Returns:
        0-dim loss.

    Formula: ``(1/N) sum_b (sum_t m_bt x_bt / sum_t m_bt)``.
    Source: Shao et al. 2024, "DeepSeekMath", eq. 3 (the 1/G sum_i 1/|o_i| sum_t GRPO objective).
    Degenerate: a fully masked row contributes 0 and is not counted in the default N.
    """
    del max_len
    x, valid = _masked(per_token, mask)
    row = x.sum(dim=-1) / valid.sum(dim=-1).to(x.dtype).clamp(min=1)
    denom = _nonempty_rows(valid, x.dtype) if normaliser is None else normaliser
    return row.sum() / denom


def seq_mean_token_sum(
    per_token: Tensor, mask: Tensor, *, normaliser: Tensor | float | None, max_len: int | None
) -> Tensor:
    """Mean over sequences of each sequence's token sum: longer sequences weigh more.

    Args:
        per_token: (B, T) loss.
        mask: (B, T) bool/0-1.
        normaliser: N; None = rows with at least one valid token here (at least 1), which is what a
            micro-batch must be given for the whole batch (``batch_normaliser``).
        max_len: unused.

    Returns:
        0-dim loss.

    Formula: ``(1/N) sum_b sum_t m_bt x_bt``.
    Source: verl ``agg_loss`` "seq-mean-token-sum".
    Degenerate: a fully masked row contributes 0 and is not counted in the default N.
    """
    del max_len
    x, valid = _masked(per_token, mask)
    denom = _nonempty_rows(valid, x.dtype) if normaliser is None else normaliser
    return x.sum() / denom


def seq_mean_token_sum_norm(
    per_token: Tensor, mask: Tensor, *, normaliser: Tensor | float | None, max_len: int | None
) -> Tensor:
    """Dr. GRPO aggregation: token sums divided by a constant length, averaged over sequences.

    Args:
        per_token: (B, T) loss.
        mask: (B, T) bool/0-1.
        normaliser: N; None = B, every row, empty or not (the denominator must not depend on the
            content); a micro-batch is given the whole batch's B (``batch_normaliser``).
        max_len: the constant length divisor, normally the generation budget (max new tokens). None = T,
            which is only constant if batches are padded to a fixed length.

    Returns:
        0-dim loss.

    Formula: ``(1/N) sum_b sum_t m_bt x_bt / L``, L = max_len.
    Source: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO),
        Sec. 3, which replaces GRPO's 1/|o_i| by a constant. verl's "seq-mean-token-sum-norm" divides
        each sequence's token sum by ``loss_scale_factor`` (default: the mask's padded length T, which
        is constant only when batches are padded to a fixed length; here ``max_len``) and averages over
        the global batch size, as here; its early versions (``agg_loss`` before the global-batch
        denominators) summed over sequences with no 1/B.
    Degenerate: a fully masked row contributes 0 (and counts in the default N).
    """
    x, _ = _masked(per_token, mask)
    L = per_token.shape[-1] if max_len is None else max_len
    denom = per_token.shape[0] if normaliser is None else normaliser
    return x.sum() / L / denom


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    normaliser: Tensor | float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar with the named mode.

    Args:
        per_token: (B, T) loss (e.g. ``LossOut.per_token``).
        mask: (B, T) bool/0-1, 1 on tokens that count.
        mode: an ``AGGREGATIONS`` name.
        normaliser: optional global denominator (tokens for ``token_mean``, sequences for the ``seq_*``
            modes); see the module docstring for gradient accumulation.
        max_len: constant length divisor for ``seq_mean_token_sum_norm``; ignored by the others.

    Returns:
        0-dim loss.

    Formula and source: see the mode's function.
    Degenerate: fully masked rows contribute 0; never NaN with the default normaliser.

    Raises:
        ValueError: if ``mode`` is unknown; the message lists the valid names.
    """
    return get_aggregation(mode)(per_token, mask, normaliser=normaliser, max_len=max_len)


def batch_normaliser(mask: Tensor, mode: str) -> Tensor:
    """The denominator ``mode`` uses over a whole batch, to give every micro-batch of it (the module
    docstring, "Gradient accumulation").

    Args:
        mask: (B, T) bool/0-1 of the whole batch.
        mode: an ``AGGREGATIONS`` name.

    Returns:
        0-dim float tensor: valid tokens (``token_mean``); rows with a valid token
        (``seq_mean_token_mean``, ``seq_mean_token_sum``); B (``seq_mean_token_sum_norm``). At least 1.

    Formula: with micro-batches k, ``sum_k agg(x_k, m_k; N) = agg(x, m)`` when N is this count, since each
    mode is ``(1/N) * (a sum over rows)``.
    Source: the denominators of each mode's own formula; verl ``agg_loss`` with global batch info.
    Degenerate: an all-masked batch gives 1 for the token and non-empty-row counts (its loss is 0).
    """
    get_aggregation(mode)  # refuses an unknown name, listing the valid ones
    valid = mask.to(torch.bool)
    if mode == "token_mean":
        return valid.sum().to(torch.float32).clamp(min=1)
    if mode == "seq_mean_token_sum_norm":
        return torch.tensor(float(max(mask.shape[0], 1)), device=mask.device)
    return _nonempty_rows(valid, torch.float32)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is true.

    Args:
        x: any shape.
        mask: same shape, bool/0-1.

    Returns:
        0-dim tensor (differentiable; detach for logging).

    Formula: ``sum(m x) / sum(m)``.
    Degenerate: an all-false mask gives 0.
    """
    xm, valid = _masked(x, mask)
    return xm.sum() / valid.sum().to(xm.dtype).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Standardise ``x`` with the mean and population std of its valid positions (PPO advantage norm).

    Args:
        x: (B, T) values, e.g. GAE advantages.
        mask: (B, T) bool/0-1.
        shift_mean: subtract the mean; False only rescales (keeps the mean).
        eps: added to the std.

    Returns:
        (B, T) whitened values, 0 where mask is 0.

    Formula: ``(x - mean_m(x)) / (std_m(x) + eps)``; with ``shift_mean=False``, ``x / (std_m(x) + eps)``.
    Source: OpenAI baselines ``ppo2`` advantage normalisation; verl ``masked_whiten``.
    Degenerate: an all-false mask gives zeros; constant valid values give zeros when shift_mean.
    """
    xm, valid = _masked(x, mask)
    mean = masked_mean(xm, valid)
    var = masked_mean((xm - mean) ** 2, valid)
    out = (xm - mean) / (var.sqrt() + eps) if shift_mean else xm / (var.sqrt() + eps)
    return torch.where(valid, out, torch.zeros_like(out))


def get_aggregation(name: str) -> AggregationFn:
    """Look up an aggregation mode by registry name.

    Args:
        name: one of the keys of ``AGGREGATIONS``.

    Returns:
        ``fn(per_token, mask, *, normaliser, max_len) -> 0-dim tensor``.

    Raises:
        ValueError: if the name is unknown; the message lists the valid names.
    """
    return lookup(AGGREGATIONS, name, "aggregation mode")


AGGREGATIONS: Mapping[str, AggregationFn] = MappingProxyType(
    {
        "token_mean": token_mean,
        "seq_mean_token_mean": seq_mean_token_mean,
        "seq_mean_token_sum": seq_mean_token_sum,
        "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
    }
)
