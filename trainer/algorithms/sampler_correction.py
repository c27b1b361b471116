"""The trainer/sampler mismatch: how far the rollout engine's log-probs of the sampled tokens are from the
trainer's, and truncated importance sampling (TIS) to correct the policy gradient for it.

An engine such as vLLM samples with its own kernels (fused attention, another matmul order, bf16), so the
distribution that drew a token, ``pi_sampler``, is not exactly the trainer's ``pi_old`` with the same
weights: the "on-policy" update is slightly off-policy. Yao et al. 2025 ("Your efficient RL framework
secretly brings you off-policy RL training", Feng Yao, Liyuan Liu et al., blog and verl ``rollout_is``)
measure the gap and correct it with a per-token importance weight ``pi_old / pi_sampler`` truncated at a
cap ``C``; TRL's ``vllm_importance_sampling_correction`` does the same. Both inputs here are per-token
log-probs of the *sampled* tokens, (B, T); nothing is masked except where a mask is given.
"""

from __future__ import annotations

import torch
from torch import Tensor


def importance_ratio(old_logp: Tensor, sampler_logp: Tensor) -> Tensor:
    """Per-token importance ratio of the trainer's old policy to the sampler.

    Args:
        old_logp: (B, T) trainer log-probs of the sampled tokens under the weights that sampled them.
        sampler_logp: (B, T) the engine's log-probs of the same tokens (what it sampled from).

    Returns:
        (B, T) ``rho_t = pi_old(y_t) / pi_sampler(y_t)``, without grad.

    Formula: ``rho_t = exp(log pi_old - log pi_sampler)``, the log-difference clipped to [-20, 20] so that a
        token the trainer finds impossible (or the sampler does) gives a large finite ratio, not inf.
    Source: Yao et al. 2025, eq. for the token-level IS weight; verl ``rollout_is``.
    Degenerate: equal log-probs -> 1.
    """
    return torch.exp((old_logp - sampler_logp).detach().float().clamp(-20.0, 20.0))


def truncated_is_weights(old_logp: Tensor, sampler_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights that multiply the per-token policy-gradient term.

    Args:
        old_logp: (B, T) trainer log-probs of the sampled tokens under the sampling weights.
        sampler_logp: (B, T) the engine's log-probs of the same tokens.
        cap: the truncation ``C >= 1``; weights above it are cut to it (bounded variance).

    Returns:
        (B, T) ``w_t = min(rho_t, C)``, without grad (a constant factor of the loss, as in the paper).

    Formula: the corrected policy gradient is ``E_{y ~ pi_sampler}[ min(pi_old/pi_sampler, C) *
        grad A_t ... ]``: ``loss_t <- w_t * loss_t`` for the policy term only (the KL and entropy terms are
        not reweighted, as in TRL).
    Source: Yao et al. 2025 (truncated IS, "TIS"); TRL ``vllm_importance_sampling_cap`` (default 2).
    Degenerate: equal log-probs -> 1 everywhere.
    """
    if cap < 1:
        raise ValueError(f"the importance-sampling cap must be >= 1, got {cap}")
    return importance_ratio(old_logp, sampler_logp).clamp(max=cap)


def mismatch_stats(
    old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float | None = None
) -> dict[str, Tensor]:
    """How far the sampler is from the trainer over the tokens that count (``mask`` 1).

    Args:
        old_logp: (B, T) trainer log-probs of the sampled tokens.
        sampler_logp: (B, T) the engine's log-probs of the same tokens.
        mask: (B, T) 1 for the tokens that count, 0 for padding and prompt.
        cap: the TIS cap, if the run corrects: adds the fraction of tokens whose ratio it cut.

    Returns:
        Scalars, keyed as logged: ``mismatch/logp_abs_diff`` = mean_t |log pi_old - log pi_sampler|;
        ``mismatch/ratio_mean``, ``mismatch/ratio_min``, ``mismatch/ratio_max`` and ``mismatch/ratio_std``
        (population std) of ``rho_t``; ``mismatch/kl`` = the k3 estimate of KL(pi_sampler || pi_old) under
        the sampler's tokens, mean_t (rho_t - 1 - log rho_t); with ``cap``, ``mismatch/capped_frac`` = the
        share of tokens with ``rho_t > cap``.
    Source: the diagnostics of Yao et al. 2025 and TRL's ``sampling/`` metrics.
    Degenerate: no token counts -> every stat 0 (the ratio stats 1); equal log-probs -> no mismatch.
    """
    keep = mask.detach() > 0
    diff = (old_logp - sampler_logp).detach().float()[keep]
    if diff.numel() == 0:
        ones, zero = torch.ones((), device=mask.device), torch.zeros((), device=mask.device)
        empty = {"logp_abs_diff": zero, "ratio_mean": ones, "ratio_min": ones, "ratio_max": ones}
        empty |= {"ratio_std": zero, "kl": zero} | ({"capped_frac": zero} if cap is not None else {})
        return {f"mismatch/{k}": v for k, v in empty.items()}
    log_rho = diff.clamp(-20.0, 20.0)
    rho = torch.exp(log_rho)
    out = {
        "logp_abs_diff": diff.abs().mean(),
        "ratio_mean": rho.mean(),
        "ratio_min": rho.min(),
        "ratio_max": rho.max(),
        "ratio_std": rho.std(unbiased=False),
        "kl": (torch.expm1(log_rho) - log_rho).mean(),
    }
    if cap is not None:
        out["capped_frac"] = (rho > cap).float().mean()
    return {f"mismatch/{k}": v for k, v in out.items()}
