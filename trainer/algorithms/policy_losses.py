"""Per-token policy-gradient losses and truncated importance weights.

Every loss has the call shape ``fn(logp, old_logp, adv, mask, *, clip: ClipParams) -> LossOut``. The
per-token loss is *not* reduced: the loop passes it to ``aggregation.aggregate`` with its mode. Clip-higher
(DAPO) is ``ppo_clip`` with ``high > low``; dual-clip is ``ppo_clip`` with ``dual_c`` set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch
from torch import Tensor

from trainer.algorithms._registry import lookup

# exp(20) ~ 4.9e8: beyond any useful ratio, and keeps exp() and its backward finite.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class ClipParams:
    """Clipping of the importance ratio, built by the loop from the spec.

    Attributes:
        low: the ratio is clipped below at ``1 - low`` (PPO epsilon; 0 <= low <= 1: 1 sets no lower
            bound, as CISPO's paper does).
        high: the ratio is clipped above at ``1 + high`` (> 0). ``high > low`` is DAPO's clip-higher.
        dual_c: dual-clip bound c (> 1): for negative advantages the loss is capped at ``-adv * c``.
            None disables dual-clip.
    """

    low: float = 0.2
    high: float = 0.2
    dual_c: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= 1.0 or self.high <= 0.0:
            raise ValueError(f"need 0 <= low <= 1 and high > 0, got low={self.low} high={self.high}")
        if self.dual_c is not None and self.dual_c <= 1.0:
            raise ValueError(f"dual_c must be > 1, got {self.dual_c}")


@dataclass(frozen=True)
class LossOut:
    """A per-token loss and its detached statistics.

    Attributes:
        per_token: (B, T) loss, differentiable, 0 where mask is 0.
        stats: 0-dim detached tensors (masked means over valid tokens), e.g. ``"clipfrac"``,
            ``"approx_kl"``. The loop calls ``.item()`` when it logs, not here.
    """

    per_token: Tensor
    stats: dict[str, Tensor]


class PolicyLossFn(Protocol):
    """Registry call shape of the policy losses."""

    def __call__(
        self, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip: ClipParams
    ) -> LossOut:
        """Compute the per-token loss."""
        ...


def _masked_mean(x: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor:
    """Mean of x over valid positions as ``dtype``, 0 if none; detached."""
    x = x.detach().to(dtype)
    total = torch.where(valid, x, torch.zeros_like(x)).sum()
    return total / valid.sum().clamp(min=1).to(x.dtype)


def _prepare(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcast adv to (B, T); return (log_ratio, ratio, adv, valid)."""
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = adv.expand_as(logp)
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return log_ratio, log_ratio.exp(), adv, mask.to(torch.bool)


def _approx_kl(log_ratio: Tensor, ratio: Tensor, valid: Tensor) -> Tensor:
    """k3 estimate of KL(old || new) from samples of the old policy: ``(r - 1) - log r`` (cleanrl)."""
    return _masked_mean((ratio - 1.0) - log_ratio, valid, ratio.dtype)


def ppo_clip(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip: ClipParams) -> LossOut:
    """PPO clipped surrogate loss, with asymmetric bounds and optional dual-clip.

    Args:
        logp: (B, T) current policy log-probs of the sampled tokens (requires grad).
        old_logp: (B, T) log-probs of the policy that sampled (or of the start of the update).
        adv: (B, T) token advantages, or (B,) sequence advantages broadcast over tokens.
        mask: (B, T) bool/0-1, 1 on tokens that count.
        clip: ``low``, ``high`` and ``dual_c``.

    Returns:
        ``LossOut(per_token (B, T), stats)`` with stats ``"clipfrac"`` (fraction of valid tokens where the
        clipped term is the active one), ``"approx_kl"`` (k3 of KL(old || new)) and, when dual-clip is on,
        ``"dual_clipfrac"`` (fraction where the dual bound is active).

    Formula: ``r = exp(logp - old_logp)`` (log-ratio clamped to +-20);
        ``L = max(-A r, -A clip(r, 1 - low, 1 + high))``; with dual-clip, for ``A < 0``:
        ``L = min(L, -A c)``.
    Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7; Yu et al. 2025,
        "DAPO", Sec. 3.1 (clip-higher); Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
        Reinforcement Learning" (dual-clip PPO).
    Degenerate: 0 loss and 0 gradient where mask is 0 or A = 0. Past the clip on the improving side
        (``r > 1 + high`` with A > 0, or ``r < 1 - low`` with A < 0) the gradient is 0. At r = 1 the
        gradient equals the vanilla policy gradient ``-A grad logp``.
    """
    log_ratio, ratio, adv, valid = _prepare(logp, old_logp, adv, mask)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    loss = torch.maximum(unclipped, clipped)
    stats = {
        "clipfrac": _masked_mean(clipped > unclipped, valid, logp.dtype),
        "approx_kl": _approx_kl(log_ratio, ratio, valid),
    }
    if clip.dual_c is not None:
        bound = -adv * clip.dual_c
        dual_active = (adv < 0) & (bound < loss)
        loss = torch.where(dual_active, bound, loss)
        stats["dual_clipfrac"] = _masked_mean(dual_active, valid, logp.dtype)
    per_token = torch.where(valid, loss, torch.zeros_like(loss))
    return LossOut(per_token, stats)


def vanilla(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip: ClipParams) -> LossOut:
    """Unclipped importance-weighted policy gradient.

    Args:
        logp: (B, T) current policy log-probs of the sampled tokens (requires grad).
        old_logp: (B, T) log-probs of the sampling policy; equal to ``logp.detach()`` on-policy.
        adv: (B, T) token advantages, or (B,) sequence advantages broadcast over tokens.
        mask: (B, T) bool/0-1, 1 on tokens that count.
        clip: not applied; used only for the ``"clipfrac"`` diagnostic.

    Returns:
        ``LossOut(per_token (B, T), stats)`` with ``"clipfrac"`` (fraction of valid tokens where
        ``ppo_clip`` with the same ``clip`` would be clipping; nothing is clipped here) and
        ``"approx_kl"``.

    Formula: ``L = -A exp(logp - old_logp)``; on-policy its gradient is REINFORCE's ``-A grad logp``.
    Source: Williams 1992 (REINFORCE); Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
        eq. 6 (L^CPI, the surrogate without clipping).
    Degenerate: 0 where mask is 0 or A = 0; unbounded when the ratio grows (no trust region).
    """
    log_ratio, ratio, adv, valid = _prepare(logp, old_logp, adv, mask)
    loss = -adv * ratio
    would_clip = -adv * ratio.clamp(1.0 - clip.low, 1.0 + clip.high) > loss
    per_token = torch.where(valid, loss, torch.zeros_like(loss))
    stats = {
        "clipfrac": _masked_mean(would_clip, valid, logp.dtype),
        "approx_kl": _approx_kl(log_ratio, ratio, valid),
    }
    return LossOut(per_token, stats)


def gspo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip: ClipParams) -> LossOut:
    """GSPO: the PPO clip on a length-normalised sequence-level importance ratio (GSPO-token form).

    Args:
        logp: (B, T) current policy log-probs of the sampled tokens (requires grad).
        old_logp: (B, T) log-probs of the policy that sampled.
        adv: (B,) sequence advantages A_i (the group family), or (B, T) token advantages A_it (PPO's
            GAE): GSPO-token's per-token form, which equals the sequence form when A_it = A_i.
        mask: (B, T) bool/0-1, 1 on tokens that count.
        clip: ``low`` and ``high`` bound the *sequence* ratio (the paper uses 3e-4 and 4e-4);
            ``dual_c`` is not used.

    Returns:
        ``LossOut(per_token (B, T), stats)``: every valid token of sequence i carries the sequence's loss
        value; ``"clipfrac"`` (fraction of valid tokens whose sequence is clipped) and ``"approx_kl"``.

    Formula: ``s_i = exp((1/|y_i|) sum_t (logp_it - old_it))``;
        ``J = mean_i min(s_i A_i, clip(s_i, 1 - low, 1 + high) A_i)``. Per token (GSPO-token, eq. 13-14):
        ``s_it = sg(s_i) * exp(logp_it - sg(logp_it))`` (value s_i) and ``L_it = max(-A_it s_it,
        -A_it clip(s_it, ...))``; with A_it = A_i and ``seq_mean_token_mean`` its gradient is exactly
        GSPO's, ``-A_i s_i (1/|y_i|) sum_t grad logp_it`` where unclipped; with token advantages each
        token's gradient is ``-A_it s_i (1/|y_i|) grad logp_it`` (eq. 14).
    Source: Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7 (sequence objective) and
        eq. 13-14 (GSPO-token).
    Degenerate: a sequence with no valid token has loss 0; on-policy s_i = 1 and the gradient is the
        length-normalised policy gradient.
    """
    valid = mask.to(torch.bool)
    log_ratio = torch.where(valid, (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO), 0.0)
    n = valid.sum(-1).clamp(min=1).to(logp.dtype)
    seq_log_ratio = (log_ratio.sum(-1) / n).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # (B,)
    seq_ratio = seq_log_ratio.exp()
    token_ratio = seq_ratio.detach().unsqueeze(-1) * (logp - logp.detach()).exp()  # value s_i, grad per token
    a = adv.unsqueeze(-1).expand_as(logp) if adv.dim() == 1 else adv
    unclipped = -a * token_ratio
    clipped = -a * token_ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    loss = torch.maximum(unclipped, clipped)
    per_token = torch.where(valid, loss, torch.zeros_like(loss))
    ratio = log_ratio.exp()
    stats = {
        "clipfrac": _masked_mean(clipped > unclipped, valid, logp.dtype),
        "approx_kl": _approx_kl(log_ratio, ratio, valid),
    }
    return LossOut(per_token, stats)


def cispo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip: ClipParams) -> LossOut:
    """CISPO: REINFORCE weighted by the clipped, stop-gradient importance ratio; no token is dropped.

    Args:
        logp: (B, T) current policy log-probs of the sampled tokens (requires grad).
        old_logp: (B, T) log-probs of the policy that sampled.
        adv: (B, T) token advantages, or (B,) sequence advantages broadcast over tokens.
        mask: (B, T) bool/0-1, 1 on tokens that count.
        clip: the importance weight is clipped to ``[1 - low, 1 + high]`` (the paper sets no lower bound:
            ``low`` 1.0 gives 0); ``dual_c`` is not used.

    Returns:
        ``LossOut(per_token (B, T), stats)`` with ``"clipfrac"`` (fraction of valid tokens whose weight was
        clipped) and ``"approx_kl"``.

    Formula: ``r = exp(logp - old_logp)``; ``L_t = -sg(clip(r_t, 1 - low, 1 + high)) A_t logp_t``, so
        ``grad L_t = -clip(r_t) A_t grad logp_t`` for every token, clipped or not (PPO's clip would give 0).
    Source: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
        Sec. 3.1, eq. 4-5 (CISPO).
    Degenerate: 0 where mask is 0 or A = 0; on-policy (r = 1) it is REINFORCE's ``-A logp`` (the loss
        value is not the PPO surrogate's: it is ``-A logp``, whose gradient is the policy gradient).
    """
    log_ratio, ratio, adv, valid = _prepare(logp, old_logp, adv, mask)
    weight = ratio.detach().clamp(max(0.0, 1.0 - clip.low), 1.0 + clip.high)
    loss = -weight * adv * logp
    per_token = torch.where(valid, loss, torch.zeros_like(loss))
    stats = {
        "clipfrac": _masked_mean(weight != ratio.detach(), valid, logp.dtype),
        "approx_kl": _approx_kl(log_ratio, ratio, valid),
    }
    return LossOut(per_token, stats)


def truncated_is_weights(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, cap: float) -> Tensor:
    """Truncated importance-sampling weights that correct for a rollout engine's numerics (TIS).

    The rollout engine (e.g. vLLM) and the trainer compute slightly different probabilities for the same
    tokens, so "on-policy" samples are in fact off-policy. Multiply the per-token policy loss by these
    weights: ``loss = out.per_token * truncated_is_weights(...)``.

    Args:
        trainer_logp: (B, T) log-probs of the sampled tokens under the trainer's copy of the sampling
            policy (the ``old_logp`` recomputed by the trainer).
        rollout_logp: (B, T) log-probs reported by the rollout engine for the same tokens.
        mask: (B, T) bool/0-1, 1 on valid tokens.
        cap: truncation C (> 0); Yao et al. use C = 2.

    Returns:
        (B, T) detached weights ``min(exp(trainer_logp - rollout_logp), cap)``, 0 where mask is 0.

    Formula: ``w_t = min(pi_trainer(y_t) / pi_rollout(y_t), C)``, treated as a constant (no gradient).
    Source: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
        (blog), truncated importance sampling.
    Degenerate: identical log-probs give weight 1; log-ratio is clamped to +-20 before exp.
    """
    log_ratio = (trainer_logp - rollout_logp).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    w = log_ratio.exp().clamp(max=cap)
    return torch.where(mask.to(torch.bool), w, torch.zeros_like(w))


def get_policy_loss(name: str) -> PolicyLossFn:
    """Look up a policy loss by registry name.

    Args:
        name: one of the keys of ``POLICY_LOSSES``.

    Returns:
        ``fn(logp, old_logp, adv, mask, *, clip) -> LossOut``.

    Raises:
        ValueError: if the name is unknown; the message lists the valid names.
    """
    return lookup(POLICY_LOSSES, name, "policy loss")


POLICY_LOSSES: Mapping[str, PolicyLossFn] = MappingProxyType(
    {
        "ppo_clip": ppo_clip,
        "vanilla": vanilla,
        "gspo": gspo,
        "cispo": cispo,
    }
)
