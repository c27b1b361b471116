"""Value-function loss for the PPO critic."""

from __future__ import annotations

import torch
from torch import Tensor


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip_range: float | None
) -> Tensor:
    """Clipped squared-error value loss, per token.

    Args:
        values: (B, T) current value predictions (requires grad).
        old_values: (B, T) value predictions made at rollout time (the GAE inputs).
        returns: (B, T) regression targets (``gae(...)[1]``).
        mask: (B, T) bool/0-1, 1 on tokens that count.
        clip_range: epsilon for clipping the value change around ``old_values``; None for the plain
            squared error.

    Returns:
        (B, T) loss, 0 where mask is 0; reduce with ``aggregation.aggregate``.

    Formula: ``V_clip = old + clip(V - old, -eps, eps)``;
        ``L = 0.5 * max((V - R)^2, (V_clip - R)^2)``; without clipping ``L = 0.5 (V - R)^2``.
    Source: Schulman et al. 2017 PPO reference implementation (OpenAI baselines ``ppo2``, ``cliprange_vf``);
        cleanrl ``ppo.py`` (``clip_vloss``); the pessimistic max is what makes it a trust region.
    Degenerate: 0 where mask is 0 (inputs there may be garbage, including inf). Past the clip in the
        direction away from ``old_values`` the gradient is 0 whenever the clipped error is the larger one.
    """
    err = (values - returns) ** 2
    if clip_range is not None:
        clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        err = torch.maximum(err, (clipped - returns) ** 2)
    loss = 0.5 * err
    return torch.where(mask.to(torch.bool), loss, torch.zeros_like(loss))
