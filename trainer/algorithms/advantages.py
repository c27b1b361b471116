"""Advantage estimators.

Outcome advantages (one scalar per sequence) share one call shape, ``fn(b: OutcomeBatch) -> (B,)``, and live
in ``ADVANTAGES``. The token-level ``gae`` needs values, gamma and lambda and is used only by the PPO loop, so
it is a plain function outside the registry.

Decisions shared by the group estimators (grpo, dr_grpo, rloo, reinforce_baseline):

* Groups are rows with equal ``group_ids``; ids need not be contiguous or sorted.
* A group whose scores are all equal gets advantage exactly 0 (checked with max == min, so float rounding
  in the mean cannot leave a ~1e-17 residue that std-scaling would blow up).
* A singleton group therefore gets 0: with one sample there is no baseline to compare against, so it
  carries no learning signal. (verl returns the raw score instead; TRL's RLOO yields 0 after NaN handling.)
* Standard deviations are population std (divide by n, not n - 1): GRPO advantages within a group then
  have mean 0 and variance 1, and for binary rewards with success rate p they are ``sqrt((1-p)/p)`` for
  correct and ``-sqrt(p/(1-p))`` for wrong samples (Mroueh 2025). verl and TRL use Bessel's n - 1, which
  scales every advantage by ``sqrt((n-1)/n)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import NamedTuple

import torch
from torch import Tensor

from trainer.algorithms._registry import lookup


@dataclass(frozen=True)
class OutcomeBatch:
    """Inputs of the outcome-advantage estimators.

    Attributes:
        scores: (B,) float sequence-level reward.
        group_ids: (B,) int64; rows with the same id are completions of the same prompt.
        baseline: (B,) optional per-row baseline, e.g. the ReMax greedy-decoding reward. None if unused.
    """

    scores: Tensor
    group_ids: Tensor
    baseline: Tensor | None = None


OutcomeAdvantageFn = Callable[[OutcomeBatch], Tensor]


class _GroupStats(NamedTuple):
    """Per-row statistics of the row's group, each (B,)."""

    size: Tensor
    total: Tensor
    mean: Tensor
    std: Tensor  # population std
    equal: Tensor  # bool: every score in the group is identical (max == min)


def _group_stats(scores: Tensor, group_ids: Tensor) -> _GroupStats:
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    G = uniq.shape[0]

    def per_group(src: Tensor) -> Tensor:
        return torch.zeros(G, dtype=scores.dtype, device=scores.device).index_add_(0, inv, src)

    count = per_group(torch.ones_like(scores))
    total = per_group(scores)
    mean = (total / count)[inv]
    std = (per_group((scores - mean) ** 2) / count).sqrt()[inv]
    hi = torch.full((G,), -torch.inf, dtype=scores.dtype, device=scores.device)
    lo = torch.full((G,), torch.inf, dtype=scores.dtype, device=scores.device)
    hi = hi.scatter_reduce(0, inv, scores, reduce="amax")
    lo = lo.scatter_reduce(0, inv, scores, reduce="amin")
    return _GroupStats(count[inv], total[inv], mean, std, (hi == lo)[inv])


def grpo(b: OutcomeBatch, *, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantage: the score standardised within its group.

    Args:
        b: ``scores`` (B,), ``group_ids`` (B,); ``baseline`` is ignored.
        scale_by_std: divide by the group std (GRPO). False gives Dr. GRPO, which only centres.
        eps: added to the std before dividing.

    Returns:
        (B,) advantage, to be broadcast over the sequence's tokens.

    Formula: ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)``, population std over the group g of i;
        without std scaling ``A_i = r_i - mean_g(r)``.
    Source: Shao et al. 2024, "DeepSeekMath", Sec. 4.1.2 (outcome supervision); Liu et al. 2025,
        "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO, Sec. 3).
    Degenerate: all-equal group (std 0) and singleton group -> exactly 0. Sums to 0 within each group.
    """
    g = _group_stats(b.scores, b.group_ids)
    centred = b.scores - g.mean
    if scale_by_std:
        centred = centred / (g.std + eps)
    return torch.where(g.equal, torch.zeros_like(centred), centred)


def rloo(b: OutcomeBatch) -> Tensor:
    """REINFORCE leave-one-out advantage: the score minus the mean of the other samples of its group.

    Args:
        b: ``scores`` (B,), ``group_ids`` (B,); ``baseline`` is ignored.

    Returns:
        (B,) advantage.

    Formula: ``A_i = r_i - (1/(n-1)) sum_{j != i} r_j = n/(n-1) (r_i - mean_g(r))``, n the group size.
        So for equal group sizes ``dr_grpo == rloo * (n-1)/n``.
    Source: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al.
        2024, "Back to Basics: Revisiting REINFORCE Style Optimization for RLHF", RLOO.
    Degenerate: singleton group (no other sample) and all-equal group -> exactly 0.
    """
    g = _group_stats(b.scores, b.group_ids)
    adv = b.scores - (g.total - b.scores) / (g.size - 1).clamp(min=1)
    return torch.where(g.equal | (g.size < 2), torch.zeros_like(adv), adv)


def reinforce(b: OutcomeBatch) -> Tensor:
    """Plain REINFORCE: the advantage is the score itself (no baseline).

    Args:
        b: ``scores`` (B,); ``group_ids`` and ``baseline`` are ignored.

    Returns:
        (B,) advantage, a copy of the scores.

    Formula: ``A_i = r_i``.
    Source: Williams 1992, "Simple statistical gradient-following algorithms" (REINFORCE with baseline b = 0).
    Degenerate: none; high variance by design.
    """
    return b.scores.clone()


def _whiten(x: Tensor, eps: float) -> Tensor:
    """Batch standardisation with population std; a constant batch maps to exactly 0."""
    if x.numel() == 0:
        return x.clone()
    out = (x - x.mean()) / (x.std(correction=0) + eps)
    return torch.where(x.amax() == x.amin(), torch.zeros_like(out), out)


def reinforce_pp(b: OutcomeBatch, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ outcome advantage: the score standardised over the whole batch.

    Args:
        b: ``scores`` (B,); ``group_ids`` and ``baseline`` are ignored.
        eps: added to the batch std.

    Returns:
        (B,) advantage.

    Formula: ``A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps)`` (population std). REINFORCE++ also
        folds a per-token KL penalty into the return before whitening; here the outcome score is whitened
        and the KL goes into the loss (or into ``scores`` by the caller).
    Source: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models"
        (global advantage normalisation).
    Degenerate: a batch of equal scores -> exactly 0; B = 0 -> empty.
    """
    return _whiten(b.scores, eps)


def reinforce_baseline(b: OutcomeBatch, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean, then divide by the std of the whole batch.

    Args:
        b: ``scores`` (B,), ``group_ids`` (B,); ``baseline`` is ignored.
        eps: added to the batch std.

    Returns:
        (B,) advantage.

    Formula: ``c_i = r_i - mean_g(r)``; ``A_i = c_i / (std_batch(c) + eps)`` (population std; c has batch
        mean 0 already). Unlike GRPO the scale is global, so groups with a small spread are not inflated.
    Source: Hu 2025, "REINFORCE++", the REINFORCE++-baseline variant (verl ``reinforce_plus_plus_baseline``).
    Degenerate: all-equal or singleton group -> 0 (its centred scores are 0); if every group is
        all-equal, the whole batch is 0.
    """
    g = _group_stats(b.scores, b.group_ids)
    centred = torch.where(g.equal, torch.zeros_like(b.scores), b.scores - g.mean)
    if centred.numel() == 0:
        return centred
    out = centred / (centred.std(correction=0) + eps)
    return torch.where(g.equal, torch.zeros_like(out), out)


def remax(b: OutcomeBatch) -> Tensor:
    """ReMax advantage: the score minus the reward of the greedy completion of the same prompt.

    Args:
        b: ``scores`` (B,) and ``baseline`` (B,), the greedy-decoding reward for each row's prompt;
            ``group_ids`` is ignored.

    Returns:
        (B,) advantage.

    Formula: ``A_i = r(x, y_i) - r(x, y_greedy)``.
    Source: Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
        for Aligning Large Language Models", Algorithm 1.
    Degenerate: a sample equal to its greedy reward -> 0.

    Raises:
        ValueError: if ``b.baseline`` is None.
    """
    if b.baseline is None:
        raise ValueError("remax needs OutcomeBatch.baseline (the greedy completion's reward)")
    return b.scores - b.baseline


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over token positions.

    Args:
        rewards: (B, T) per-token reward (e.g. ``kl_penalized_rewards``).
        values: (B, T) value estimates V(s_t).
        mask: (B, T) bool/0-1, 1 on action tokens. Masked positions (padding, or tool/observation tokens
            in a multi-turn response) are transparent: their reward and value are ignored and the
            recursion carries over them, so discounting counts valid tokens only.
        gamma: discount.
        lam: GAE lambda, a float or a (B,) tensor of per-sequence lambdas (see ``length_adaptive_lam``).

    Returns:
        ``(advantages, returns)``, each (B, T), with ``returns = advantages + values``; both 0 where
        mask is 0. No whitening (``aggregation.masked_whiten`` does that if wanted).

    Formula: ``delta_t = r_t + gamma V_{t'} - V_t`` with t' the next valid position (V = 0 after the
        last); ``A_t = delta_t + gamma lam A_{t'}``.
    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
        Estimation", eq. 16; masked recursion as in verl ``compute_gae_advantage_return``.
    Degenerate: a fully masked row gives zeros. lam = 1, gamma = 1 gives reward-to-go minus value.
    """
    B, T = rewards.shape
    m = mask.to(rewards.dtype)
    if isinstance(lam, Tensor):
        lam_b = lam.to(device=rewards.device, dtype=rewards.dtype)
    else:
        lam_b = torch.full((B,), lam, dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    last_adv = torch.zeros_like(next_value)
    out = torch.zeros_like(rewards)
    # A reverse scan is inherently sequential in T; each step is vectorised over B.
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam_b * last_adv
        valid = m[:, t] > 0
        last_adv = torch.where(valid, adv_t, last_adv)
        next_value = torch.where(valid, values[:, t], next_value)
        out[:, t] = torch.where(valid, adv_t, torch.zeros_like(adv_t))
    returns = torch.where(m > 0, out + values, torch.zeros_like(out))
    return out, returns


def length_adaptive_lam(lengths: Tensor, alpha: float) -> Tensor:
    """VC-PPO length-adaptive GAE lambda for the policy, one per sequence.

    Args:
        lengths: (B,) response lengths in tokens.
        alpha: scale; larger alpha pushes lambda towards 1 faster (the paper's alpha).

    Returns:
        (B,) lambda, same float dtype as ``lengths`` (float32 if lengths are integer).

    Formula: ``lam = 1 - 1 / (alpha * L)``, clamped to [0, 1]. Long responses get lambda near 1
        (less biased, since the value function is weak on long horizons); short ones a smaller lambda.
    Source: Yuan et al. 2025, "What's Behind PPO's Collapse in Long-CoT? Value Optimization Holds the
        Secret" (VC-PPO), length-adaptive GAE.
    Degenerate: ``alpha * L <= 1`` (including L = 0) gives 0.
    """
    L = lengths.to(torch.get_default_dtype()) if not lengths.is_floating_point() else lengths
    lam = 1.0 - 1.0 / (alpha * L)
    # alpha * L == 0 gives -inf; alpha * L < 1 gives a negative lambda: both mean "no bootstrapping".
    return lam.nan_to_num(neginf=0.0).clamp(0.0, 1.0)


def get_advantage(name: str) -> OutcomeAdvantageFn:
    """Look up an outcome-advantage estimator by registry name.

    Args:
        name: one of the keys of ``ADVANTAGES``.

    Returns:
        ``fn(b: OutcomeBatch) -> (B,)``.

    Raises:
        ValueError: if the name is unknown; the message lists the valid names.
    """
    return lookup(ADVANTAGES, name, "advantage estimator")


ADVANTAGES: Mapping[str, OutcomeAdvantageFn] = MappingProxyType(
    {
        "grpo": grpo,
        "dr_grpo": partial(grpo, scale_by_std=False),
        "rloo": rloo,
        "reinforce": reinforce,
        "reinforce_pp": reinforce_pp,
        "reinforce_baseline": reinforce_baseline,
        "remax": remax,
    }
)
