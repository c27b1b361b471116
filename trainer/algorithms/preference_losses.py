"""Pairwise preference losses (DPO family) and reward-model ranking losses (Bradley-Terry, K-wise).

DPO-family losses share one call shape, ``fn(chosen_logratio, rejected_logratio, p) -> (B,)``, where
``logratio = log pi(y|x) - log pi_ref(y|x)`` summed over the completion tokens. Each returns the
per-pair loss; the caller reduces it (usually ``.mean()``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.algorithms._registry import lookup


@dataclass(frozen=True)
class PreferenceParams:
    """Hyper-parameters of the DPO-family losses.

    Attributes:
        beta: inverse temperature of the implicit reward ``beta * logratio`` (DPO's beta). For ``ipo``
            it is the regulariser tau: the target margin is ``1 / (2 beta)``. Must be > 0.
        label_smoothing: assumed probability eps that a preference label is flipped; read by ``cdpo``
            (0 <= eps <= 1) and ``robust`` (0 <= eps < 0.5). Ignored by the other losses.
        gamma: ``simpo``'s target reward margin (>= 0). Ignored by the other losses.
    """

    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.0  # simpo's target reward margin


PreferenceLossFn = Callable[[Tensor, Tensor, PreferenceParams], Tensor]


def sigmoid(chosen_logratio: Tensor, rejected_logratio: Tensor, p: PreferenceParams) -> Tensor:
    """DPO loss: negative log-likelihood of the preference under the implicit Bradley-Terry reward.

    Args:
        chosen_logratio: (B,) ``log pi(y_w|x) - log pi_ref(y_w|x)``.
        rejected_logratio: (B,) ``log pi(y_l|x) - log pi_ref(y_l|x)``.
        p: ``beta`` is used; ``label_smoothing`` is ignored (use ``cdpo``).

    Returns:
        (B,) per-pair loss.

    Formula: ``-log sigmoid(beta * (c - r))``.
    Source: Rafailov et al. 2023, "Direct Preference Optimization", eq. 7.
    Degenerate: equal log-ratios (e.g. policy == reference at step 0) give ``log 2``.
    """
    return -F.logsigmoid(p.beta * (chosen_logratio - rejected_logratio))


def cdpo(chosen_logratio: Tensor, rejected_logratio: Tensor, p: PreferenceParams) -> Tensor:
    """Conservative DPO: DPO with labels smoothed by the flip probability eps.

    Args:
        chosen_logratio: (B,) policy/reference log-ratio of the chosen completion.
        rejected_logratio: (B,) policy/reference log-ratio of the rejected completion.
        p: ``beta`` and ``label_smoothing`` (eps, 0 <= eps <= 1).

    Returns:
        (B,) per-pair loss.

    Formula: ``h = c - r``; ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``.
    Source: Mitchell 2023, "A note on DPO with noisy preferences & relationship to IPO" (cDPO);
        TRL ``loss_type="sigmoid"`` with ``label_smoothing``.
    Degenerate: eps = 0 equals ``sigmoid``; eps = 0.5 makes the loss symmetric in (c, r): the label
        carries no information and the loss only pulls the margin towards 0.
    """
    eps = p.label_smoothing
    z = p.beta * (chosen_logratio - rejected_logratio)
    return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def robust(chosen_logratio: Tensor, rejected_logratio: Tensor, p: PreferenceParams) -> Tensor:
    """Robust DPO (rDPO): an unbiased estimate of the clean-label DPO loss under flip rate eps.

    Args:
        chosen_logratio: (B,) policy/reference log-ratio of the chosen completion.
        rejected_logratio: (B,) policy/reference log-ratio of the rejected completion.
        p: ``beta`` and ``label_smoothing`` (eps, 0 <= eps < 0.5).

    Returns:
        (B,) per-pair loss (may be negative: it is unbiased, not a likelihood).

    Formula: ``h = c - r``; ``((1 - eps)(-log sigmoid(beta h)) + eps log sigmoid(-beta h)) / (1 - 2 eps)``.
    Source: Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language Models with Noisy Feedback",
        the rDPO loss.
    Degenerate: eps = 0 equals ``sigmoid``; eps >= 0.5 raises ValueError (the estimator divides by
        ``1 - 2 eps``).

    Raises:
        ValueError: if ``label_smoothing`` is not in [0, 0.5).
    """
    eps = p.label_smoothing
    if not 0.0 <= eps < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {eps}")
    z = p.beta * (chosen_logratio - rejected_logratio)
    return ((1.0 - eps) * -F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)


def ipo(chosen_logratio: Tensor, rejected_logratio: Tensor, p: PreferenceParams) -> Tensor:
    """IPO: squared regression of the log-ratio margin onto the target ``1 / (2 beta)``.

    Args:
        chosen_logratio: (B,) policy/reference log-ratio of the chosen completion.
        rejected_logratio: (B,) policy/reference log-ratio of the rejected completion.
        p: ``beta`` (the paper's tau, > 0); ``label_smoothing`` is ignored.

    Returns:
        (B,) per-pair loss.

    Formula: ``h = c - r``; ``(h - 1 / (2 beta))^2``.
    Source: Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
        Preferences", the empirical (sampled) IPO loss. Its log-ratios are sums over tokens, as here;
        TRL averages over tokens instead, which changes the scale of ``h`` and so the meaning of ``beta``.
    Degenerate: zero exactly at margin ``1 / (2 beta)``; beta = 0 divides by zero (inf target).
    """
    h = chosen_logratio - rejected_logratio
    return (h - 1.0 / (2.0 * p.beta)) ** 2


def hinge(chosen_logratio: Tensor, rejected_logratio: Tensor, p: PreferenceParams) -> Tensor:
    """SLiC hinge loss on the implicit reward margin.

    Args:
        chosen_logratio: (B,) policy/reference log-ratio of the chosen completion.
        rejected_logratio: (B,) policy/reference log-ratio of the rejected completion.
        p: ``beta``; ``label_smoothing`` is ignored.

    Returns:
        (B,) per-pair loss.

    Formula: ``h = c - r``; ``relu(1 - beta h)``.
    Source: Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with Human Feedback"
        (the hinge calibration loss, margin 1/beta in log-ratio units); as in TRL ``loss_type="hinge"``.
    Degenerate: zero loss and zero gradient once ``beta h >= 1``.
    """
    return torch.relu(1.0 - p.beta * (chosen_logratio - rejected_logratio))


def simpo(chosen_avg_logp: Tensor, rejected_avg_logp: Tensor, p: PreferenceParams) -> Tensor:
    """SimPO: the length-normalised log-likelihood as the implicit reward, with a target margin; no
    reference model.

    Args:
        chosen_avg_logp: (B,) ``log pi(y_w|x) / |y_w|``, the chosen answer's mean token log-prob (the caller
            passes averages, not log-ratios: SimPO is reference-free).
        rejected_avg_logp: (B,) the same for the rejected answer.
        p: ``beta`` (the reward scale; the paper uses 2.0 to 2.5) and ``gamma`` (the margin, >= 0).

    Returns:
        (B,) per-pair loss.

    Formula: ``-log sigmoid(beta * (c - r) - gamma)`` with ``c, r`` the mean token log-probs.
    Source: Meng, Xia and Chen 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward",
        eq. 6 (TRL's CPOTrainer ``loss_type="simpo"`` subtracts ``gamma / beta`` inside the ``beta *``, the
        same value).
    Degenerate: equal averages give ``log(1 + e^gamma)`` (``log 2`` at gamma 0).
    """
    return -F.logsigmoid(p.beta * (chosen_avg_logp - rejected_avg_logp) - p.gamma)


def log_odds(avg_logp: Tensor) -> Tensor:
    """The log-odds of a length-normalised likelihood, as ORPO defines odds.

    Args:
        avg_logp: (B,) mean token log-probs (< 0); values above -1e-6 are taken as -1e-6 (P < 1).

    Returns:
        (B,) ``log(P / (1 - P))`` with ``P = exp(avg_logp)``.

    Formula: ``avg_logp - log(1 - exp(avg_logp))``, the second term with ``log1p(-exp(x))`` (exact near 0
    and for very negative x).
    Source: Hong, Lee and Thorne 2024, "ORPO", eq. 4 (odds) with eq. 5's length-normalised likelihood.
    Degenerate: P -> 1 would be +inf; the clamp keeps it finite (about 13.8).
    """
    return avg_logp - torch.log1p(-torch.exp(avg_logp.clamp(max=-1e-6)))


def orpo_odds_ratio(chosen_avg_logp: Tensor, rejected_avg_logp: Tensor, p: PreferenceParams) -> Tensor:
    """ORPO's odds-ratio term (the preference part; the full ORPO loss adds the chosen answer's NLL).

    Args:
        chosen_avg_logp: (B,) the chosen answer's mean token log-prob ``log P_theta(y_w|x)``.
        rejected_avg_logp: (B,) the rejected answer's.
        p: ``beta`` is ORPO's lambda (the weight of this term); ``label_smoothing`` is ignored.

    Returns:
        (B,) ``lambda * L_OR``.

    Formula: ``odds(y|x) = P(y|x) / (1 - P(y|x))`` with ``P`` the length-normalised likelihood
    ``exp(mean token log-prob)``; ``L_OR = -log sigmoid(log odds(y_w|x) - log odds(y_l|x))``; the ORPO
    objective is ``L_SFT + lambda * L_OR`` (the loop adds ``L_SFT``, the chosen NLL per token).
    Source: Hong, Lee and Thorne 2024, "ORPO: Monolithic Preference Optimization without Reference
        Model", eqs. 4-7.
    Degenerate: equal likelihoods give ``lambda * log 2``.
    """
    return -p.beta * F.logsigmoid(log_odds(chosen_avg_logp) - log_odds(rejected_avg_logp))


def kto_reference_point(policy_kl_logps: Tensor, reference_kl_logps: Tensor) -> Tensor:
    """KTO's reference point z_0: the policy's KL to the reference, estimated on mismatched pairs.

    Args:
        policy_kl_logps: (M,) ``log pi(y'|x)`` summed over tokens, for answers ``y'`` paired with prompts
            ``x`` they were not written for (each prompt with another example's answer in the batch).
        reference_kl_logps: (M,) the same under the reference.

    Returns:
        () ``max(0, mean(policy - reference))``, detached (no gradient flows through z_0).

    Formula: ``z_0 = max(0, (1/M) sum_i log pi(y'_i|x_i) - log pi_ref(y'_i|x_i))``.
    Source: Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 8 and
        the estimate of Sec. 4.1 (mismatched pairs of the same microbatch; no backpropagation through it),
        as TRL's KTOTrainer computes it.
    Degenerate: no pairs (M = 0) gives 0.
    """
    if policy_kl_logps.numel() == 0:
        return torch.zeros((), dtype=policy_kl_logps.dtype, device=policy_kl_logps.device)
    return (policy_kl_logps - reference_kl_logps).mean().clamp(min=0).detach()


def kto(logratio: Tensor, desirable: Tensor, z0: Tensor, p: KtoParams) -> Tensor:
    """KTO loss per example: one answer, desirable or not, against the reference point.

    Args:
        logratio: (B,) ``r = log pi(y|x) - log pi_ref(y|x)`` summed over the answer's tokens.
        desirable: (B,) bool, True where the answer is marked desirable.
        z0: () the reference point (``kto_reference_point``).
        p: ``beta``, ``desirable_weight`` (lambda_D) and ``undesirable_weight`` (lambda_U).

    Returns:
        (B,) ``lambda_y - v(x, y)``.

    Formula: ``v = lambda_D sigmoid(beta (r - z0))`` for a desirable answer,
    ``lambda_U sigmoid(beta (z0 - r))`` for an undesirable one; the loss is ``lambda_y - v``.
    Source: Ethayarajh et al. 2024, "KTO", eq. 8 (TRL's KTOTrainer: ``desirable_weight * (1 - sigmoid(beta
        (r - KL)))`` and ``undesirable_weight * (1 - sigmoid(beta (KL - r)))``, the same values).
    Degenerate: r = z0 gives ``lambda_y / 2``.
    """
    ones = torch.ones_like(logratio)
    sign = torch.where(desirable, ones, -ones)
    weight = torch.where(desirable, ones * p.desirable_weight, ones * p.undesirable_weight)
    return weight * (1.0 - torch.sigmoid(p.beta * sign * (logratio - z0)))


@dataclass(frozen=True)
class KtoParams:
    """KTO's hyper-parameters: ``beta`` and the class weights lambda_D, lambda_U (all > 0)."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


def chosen_nll(chosen_logps: Tensor, chosen_tokens: Tensor) -> Tensor:
    """RPO's negative log-likelihood term: the chosen answer's NLL per token, one value per pair.

    Args:
        chosen_logps: (B,) ``log pi(y_w|x)`` summed over the chosen answer's scored tokens.
        chosen_tokens: (B,) how many tokens that sum covers (at least 1).

    Returns:
        (B,) ``-log pi(y_w|x) / |y_w|``.

    Formula: the objective is ``L_DPO + alpha * L_NLL`` with ``L_NLL = -log pi(y_w|x) / |y_w|``, each pair's
    NLL normalised by its own length (TRL's ``rpo_alpha`` normalises over the batch's chosen tokens instead).
    Source: Pang et al. 2024, "Iterative Reasoning Preference Optimization", eq. 1.
    Degenerate: a count of 0 is taken as 1 (no division by zero). DPO alone can lower the chosen answers'
    likelihood along with the rejected ones' (the margin grows while both fall); this term holds them up.
    """
    return -chosen_logps / chosen_tokens.clamp(min=1).to(chosen_logps.dtype)


def bradley_terry(
    r_chosen: Tensor,
    r_rejected: Tensor,
    margin: Tensor | None = None,
    center_coef: float = 0.0,
) -> Tensor:
    """Pairwise reward-model loss: negative log-likelihood that the chosen completion wins.

    Args:
        r_chosen: (B,) scalar rewards of the chosen completions.
        r_rejected: (B,) scalar rewards of the rejected completions.
        margin: optional (B,) required reward gap (Llama 2 reward model); None means 0.
        center_coef: weight of the centring penalty ``(r_c + r_r)^2`` that keeps rewards near zero
            mean (TRL ``RewardConfig.center_rewards_coefficient``, Eisenstein et al. 2023). 0 disables.

    Returns:
        (B,) per-pair loss.

    Formula: ``-log sigmoid(r_c - r_r - margin) + center_coef * (r_c + r_r)^2``.
    Source: Bradley & Terry 1952; Ouyang et al. 2022 (InstructGPT) eq. 1; Touvron et al. 2023
        (Llama 2) eq. 2 for the margin.
    Degenerate: equal rewards and no margin give ``log 2``.
    """
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff)
    if center_coef != 0.0:
        loss = loss + center_coef * (r_chosen + r_rejected) ** 2
    return loss


def kwise_ranking(scores: Tensor, mask: Tensor | None = None) -> Tensor:
    """InstructGPT K-wise ranking loss: the mean Bradley-Terry loss over every ordered pair.

    Args:
        scores: (B, K) rewards of K completions per prompt, ordered best first (column 0 is the
            most preferred, column K-1 the least).
        mask: optional (B, K) bool/0-1, True where a candidate exists (rows with fewer than K
            candidates). Order among the valid columns is still best first.

    Returns:
        (B,) per-prompt loss.

    Formula: ``1 / C(K_b, 2) * sum_{i < j, both valid} -log sigmoid(s_i - s_j)``, with K_b the
        number of valid candidates in row b; every pair has weight ``1 / C(K_b, 2)``.
    Source: Ouyang et al. 2022, "Training language models to follow instructions with human
        feedback", eq. 1.
    Degenerate: a row with fewer than 2 valid candidates has no pair and returns 0 (no gradient,
        no NaN). K = 2 equals ``bradley_terry``.
    """
    B, K = scores.shape
    if mask is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    else:
        valid = mask.to(torch.bool)
    diff = scores.unsqueeze(2) - scores.unsqueeze(1)  # (B, K, K): s_i - s_j
    upper = torch.triu(torch.ones(K, K, dtype=torch.bool, device=scores.device), diagonal=1)
    pair = upper & valid.unsqueeze(2) & valid.unsqueeze(1)  # (B, K, K)
    # Zero the unused differences *before* logsigmoid: a masked NaN/inf score must leak neither into the
    # value nor into the gradient (where() after the op would still back-propagate NaN * 0).
    safe = torch.where(pair, diff, torch.zeros_like(diff))
    pair_loss = torch.where(pair, -F.logsigmoid(safe), torch.zeros_like(diff))
    n_pairs = pair.sum(dim=(1, 2)).to(scores.dtype)
    return pair_loss.sum(dim=(1, 2)) / n_pairs.clamp(min=1.0)


def get_preference_loss(name: str) -> PreferenceLossFn:
    """Look up a DPO-family loss by registry name.

    Args:
        name: one of the keys of ``PREFERENCE_LOSSES``.

    Returns:
        The loss function ``fn(chosen_logratio (B,), rejected_logratio (B,), p) -> (B,)``.

    Raises:
        ValueError: if the name is unknown; the message lists the valid names.
    """
    return lookup(PREFERENCE_LOSSES, name, "preference loss")


PREFERENCE_LOSSES: Mapping[str, PreferenceLossFn] = MappingProxyType(
    {
        "sigmoid": sigmoid,
        "cdpo": cdpo,
        "robust": robust,
        "ipo": ipo,
        "hinge": hinge,
        "simpo": simpo,
    }
)
# Losses of length-normalised log-likelihoods with no reference model: the loop passes each answer's mean
# token log-prob instead of a log-ratio, and loads no reference. ORPO's odds-ratio term
# (``orpo_odds_ratio``) is one too; it is the `orpo` run type's, not a DPO `loss_type`.
REFERENCE_FREE_LOSSES = frozenset({"simpo"})


@dataclass(frozen=True)
class PairObjective:
    """What a pair costs: the preference loss ``loss_fn`` of its two answers' scores, plus ``rpo_alpha``
    times its chosen answer's per-token NLL (``chosen_nll``; RPO, and ORPO's SFT term) when > 0.

    The scores are log-ratios to the reference (``log pi - log pi_ref``, summed over tokens), or with
    ``length_normalized`` (SimPO, ORPO: no reference) each answer's mean token log-prob."""

    loss_fn: PreferenceLossFn
    params: PreferenceParams
    rpo_alpha: float = 0.0
    length_normalized: bool = False

    def scores(self, chosen: Tensor, rejected: Tensor, ref: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """What ``loss_fn`` reads for pairs with policy log-probs ``chosen``/``rejected`` (B,), reference
        ``ref`` (B, 2) and ``tokens`` (B, 2) scored tokens."""
        if self.length_normalized:
            counts = tokens.to(chosen.device).clamp(min=1.0)
            return chosen / counts[:, 0], rejected / counts[:, 1]
        return chosen - ref[:, 0], rejected - ref[:, 1]

    def per_pair(
        self, chosen: Tensor, rejected: Tensor, ref: Tensor, tokens: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """(B,) losses of the pairs (see ``scores``), and (B,) their chosen NLL per token (None without
        an NLL term)."""
        loss = self.loss_fn(*self.scores(chosen, rejected, ref, tokens), self.params)
        if self.rpo_alpha == 0:
            return loss, None
        nll = chosen_nll(chosen, tokens[:, 0].to(chosen.device))
        return loss + self.rpo_alpha * nll, nll


def pair_stats(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float) -> dict[str, Tensor]:
    """Implicit rewards r = beta * log(pi/pi_ref) of chosen and rejected, their accuracy and margin.

    Args:
        chosen_logratio: (B,) the chosen answers' scores (``PairObjective.scores``), detached here.
        rejected_logratio: (B,) the rejected answers' scores.
        beta: the scale of the implicit reward.

    Returns:
        ``rewards/chosen``, ``rewards/rejected`` (means of r), ``rewards/accuracy`` (share of pairs whose
        chosen reward is higher) and ``rewards/margin`` (mean of r_chosen - r_rejected), 0-dim tensors.

    Source: Rafailov et al. 2023, "Direct Preference Optimization", section 5 (the implicit reward); the
    same four statistics TRL's DPOTrainer logs.
    Degenerate: ties count as wrong in the accuracy; no gradient flows (every input is detached).
    """
    chosen, rejected = beta * chosen_logratio.detach(), beta * rejected_logratio.detach()
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracy": (chosen > rejected).float().mean(),
        "rewards/margin": (chosen - rejected).mean(),
    }
