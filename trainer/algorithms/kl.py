"""Per-token KL estimators between the policy and a reference, and KL-shaped token rewards.

Every estimator has the call shape ``fn(logp, ref_logp) -> (B, T)``, where both inputs are log-probs of the
*sampled* tokens (sampled from the policy), and estimates ``KL(pi || pi_ref)`` token by token. Nothing is
masked here: the caller aggregates with its mask (``aggregation.aggregate``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.algorithms._registry import lookup

KLEstimatorFn = Callable[[Tensor, Tensor], Tensor]


def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Naive KL estimator: the log-ratio of the sampled token.

    Args:
        logp: (B, T) policy log-probs of the sampled tokens.
        ref_logp: (B, T) reference log-probs of the same tokens.

    Returns:
        (B, T) ``log pi - log pi_ref``; unbiased for KL(pi || pi_ref) under samples from pi, can be negative.

    Formula: ``k1 = log r`` with ``r = pi / pi_ref``.
    Source: Schulman 2020, "Approximating KL Divergence" (blog), k1.
    Degenerate: equal log-probs -> 0.
    """
    return logp - ref_logp


def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Squared log-ratio KL estimator (low variance, biased).

    Args:
        logp: (B, T) policy log-probs of the sampled tokens.
        ref_logp: (B, T) reference log-probs of the same tokens.

    Returns:
        (B, T) ``0.5 * (log pi - log pi_ref)^2``, >= 0.

    Formula: ``k2 = (log r)^2 / 2``; its gradient equals the gradient of KL(pi || pi_ref) in expectation.
    Source: Schulman 2020, "Approximating KL Divergence" (blog), k2; verl ``kl_penalty="mse"``.
    Degenerate: equal log-probs -> 0.
    """
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp: Tensor, ref_logp: Tensor, *, clamp: float | None = 10.0) -> Tensor:
    """Unbiased, non-negative KL estimator (the GRPO KL term).

    Args:
        logp: (B, T) policy log-probs of the sampled tokens.
        ref_logp: (B, T) reference log-probs of the same tokens.
        clamp: upper bound on the result; values above it are cut to it (zero gradient there), as in verl
            ``low_var_kl``. Guards against ``exp`` overflow when the policy drifts far from the reference.
            None disables clamping (exact estimator).

    Returns:
        (B, T) ``pi_ref/pi - 1 - log(pi_ref/pi)``, >= 0.

    Formula: with ``d = log pi_ref - log pi``: ``k3 = exp(d) - 1 - d``.
    Source: Schulman 2020, "Approximating KL Divergence" (blog), k3; Shao et al. 2024, "DeepSeekMath",
        eq. 4.
    Degenerate: equal log-probs -> 0.
    """
    d = ref_logp - logp
    if clamp is not None:
        # k3(+-20) > 18, so clipping d at +-20 changes nothing for clamp <= 18 and keeps exp() finite,
        # which keeps the backward pass free of 0 * inf.
        d = d.clamp(-20.0, 20.0)
    out = torch.expm1(d) - d
    if clamp is not None:
        out = out.clamp(max=clamp)
    return out


def abs_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Absolute log-ratio KL penalty (registry name ``"abs"``).

    Args:
        logp: (B, T) policy log-probs of the sampled tokens.
        ref_logp: (B, T) reference log-probs of the same tokens.

    Returns:
        (B, T) ``|log pi - log pi_ref|``, >= 0 (a penalty, not an unbiased KL estimate).

    Formula: ``|log r|``.
    Source: verl ``kl_penalty="abs"``.
    Degenerate: equal log-probs -> 0; not differentiable at 0 (torch gives gradient 0).
    """
    return (logp - ref_logp).abs()


def kl_penalized_rewards(
    scores: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    kl_coef: float | Tensor,
    estimator: str = "k1",
) -> Tensor:
    """Per-token rewards for PPO: a KL penalty on every token plus the sequence score on the last one.

    Args:
        scores: (B,) sequence reward.
        logp: (B, T) rollout policy log-probs of the sampled tokens (no gradient needed).
        ref_logp: (B, T) reference log-probs of the same tokens.
        mask: (B, T) bool/0-1, 1 on response tokens.
        kl_coef: KL coefficient beta (a float, e.g. ``AdaptiveKL.value``, or a 0-dim tensor).
        estimator: a ``KL_ESTIMATORS`` name.

    Returns:
        (B, T) rewards, 0 where mask is 0. Not detached: pass detached log-probs or call under no_grad.

    Formula: ``r_t = -beta * KL_t`` on valid tokens, plus ``score`` at the last valid token.
    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", eq. 2;
        Ouyang et al. 2022 (InstructGPT), eq. 2.
    Degenerate: a fully masked row gets all zeros (its score is dropped: there is no token to credit).

    Raises:
        ValueError: if ``estimator`` is unknown.
    """
    kl = get_kl_estimator(estimator)(logp, ref_logp)
    valid = mask.to(torch.bool)
    rewards = torch.where(valid, -kl_coef * kl, torch.zeros_like(kl))
    T = mask.shape[-1]
    positions = torch.arange(T, device=mask.device).expand_as(valid)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=-1)  # (B,), -1 if empty
    onehot = F.one_hot(last.clamp(min=0), T).to(rewards.dtype) * (last >= 0).unsqueeze(-1)
    return rewards + onehot * scores.unsqueeze(-1)


def get_kl_estimator(name: str) -> KLEstimatorFn:
    """Look up a KL estimator by registry name.

    Args:
        name: one of the keys of ``KL_ESTIMATORS``.

    Returns:
        ``fn(logp (B, T), ref_logp (B, T)) -> (B, T)``.

    Raises:
        ValueError: if the name is unknown; the message lists the valid names.
    """
    return lookup(KL_ESTIMATORS, name, "KL estimator")


KL_ESTIMATORS: Mapping[str, KLEstimatorFn] = MappingProxyType(
    {
        "k1": k1,
        "k2": k2,
        "k3": k3,
        "abs": abs_kl,
    }
)
