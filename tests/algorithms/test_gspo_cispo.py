"""GSPO and CISPO against independent transcriptions of their papers' objectives: the loss value and the
gradient of the registered per-token loss, aggregated as their presets do, equal those of the objective
written sequence by sequence (GSPO, Zheng et al. 2025 eq. 5-7) or token by token (CISPO, MiniMax-M1 eq. 4)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms.aggregation import aggregate
from trainer.algorithms.policy_losses import ClipParams, cispo, gspo, ppo_clip

F64 = torch.float64


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(4, 6, generator=gen, dtype=F64) * 2).requires_grad_(True)
    old = logp.detach() + torch.randn(4, 6, generator=gen, dtype=F64) * 0.3  # off-policy: ratios != 1
    adv = torch.tensor([1.0, -1.5, 0.5, -0.25], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]])
    return logp, old, adv, mask


def assert_same_value_and_gradient(
    ours: torch.Tensor, paper: torch.Tensor, logp: torch.Tensor
) -> torch.Tensor:
    """The two losses and their gradients with respect to ``logp`` are equal; returns ours' gradient."""
    (grad_ours,) = torch.autograd.grad(ours, logp)
    (grad_paper,) = torch.autograd.grad(paper, logp)
    torch.testing.assert_close(ours, paper)
    torch.testing.assert_close(grad_ours, grad_paper)
    return grad_ours


def gspo_paper(logp, old, adv, mask, low, high):  # type: ignore[no-untyped-def]
    """-J_GSPO: for each sequence s_i = exp(mean_t log(pi/pi_old)), min(s A, clip(s) A), mean over i."""
    total = torch.zeros((), dtype=F64)
    for i in range(logp.shape[0]):
        valid = mask[i].bool()
        s = torch.exp((logp[i][valid] - old[i][valid]).mean())
        total = total + torch.minimum(s * adv[i], s.clamp(1 - low, 1 + high) * adv[i])
    return -total / logp.shape[0]


@pytest.mark.parametrize(("seed", "low", "high"), [(0, 0.05, 0.05), (1, 0.2, 0.28), (2, 3e-4, 4e-4)])
def test_gspo_value_and_gradient_are_the_papers(seed: int, low: float, high: float) -> None:
    logp, old, adv, mask = batch(seed)
    out = gspo(logp, old, adv, mask, clip=ClipParams(low, high))
    ours = aggregate(out.per_token, mask, "seq_mean_token_mean")
    grad_ours = assert_same_value_and_gradient(ours, gspo_paper(logp, old, adv, mask, low, high), logp)
    assert grad_ours[mask == 0].abs().max() == 0


def test_gspo_on_policy_is_the_length_normalised_policy_gradient() -> None:
    logp, _, adv, mask = batch(3)
    out = gspo(logp, logp.detach(), adv, mask, clip=ClipParams(3e-4, 4e-4))
    (grad,) = torch.autograd.grad(aggregate(out.per_token, mask, "seq_mean_token_mean"), logp)
    lengths = mask.sum(-1, keepdim=True).to(F64)
    expected = -adv.unsqueeze(-1) * mask / lengths / logp.shape[0]  # -A_i / |y_i| / B on each valid token
    torch.testing.assert_close(grad, expected)
    assert out.stats["clipfrac"].item() == 0.0


def test_gspo_clips_whole_sequences() -> None:
    logp = torch.log(torch.tensor([[1.5, 1.5], [1.0, 1.0]], dtype=F64)).requires_grad_(True)
    out = gspo(
        logp,
        torch.zeros_like(logp),
        torch.tensor([1.0, 1.0], dtype=F64),
        torch.ones(2, 2),
        clip=ClipParams(0.2, 0.2),
    )
    # sequence ratios 1.5 (clipped at 1.2: every token of it) and 1.0
    torch.testing.assert_close(out.per_token, torch.tensor([[-1.2, -1.2], [-1.0, -1.0]], dtype=F64))
    assert out.stats["clipfrac"].item() == 0.5


def gspo_token_paper(logp, old, adv, mask, low, high):  # type: ignore[no-untyped-def]
    """-J_GSPO-token (eq. 13-14) token by token: s_it = sg(s_i) pi_it / sg(pi_it), each token's
    min(s_it A_it, clip(s_it) A_it), averaged over the sequence's tokens, then over sequences."""
    total = torch.zeros((), dtype=F64)
    for i in range(logp.shape[0]):
        valid = mask[i].bool()
        s_i = float(torch.exp((logp[i][valid] - old[i][valid]).mean()).detach())
        terms = []
        for t in range(logp.shape[1]):
            if mask[i, t]:
                s_it = s_i * torch.exp(logp[i, t] - logp[i, t].detach())
                terms.append(torch.minimum(s_it * adv[i, t], s_it.clamp(1 - low, 1 + high) * adv[i, t]))
        total = total + torch.stack(terms).mean()
    return -total / logp.shape[0]


@pytest.mark.parametrize(("seed", "low", "high"), [(0, 0.05, 0.05), (4, 0.2, 0.28)])
def test_gspo_with_token_advantages_is_gspo_token(seed: int, low: float, high: float) -> None:
    """PPO's GAE gives every token its own advantage: each token keeps it (the sequence ratio, the
    token's advantage), not the sequence's first token's for all."""
    logp, old, _, mask = batch(seed)
    adv = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + 10), dtype=F64)
    out = gspo(logp, old, adv, mask, clip=ClipParams(low, high))
    ours = aggregate(out.per_token, mask, "seq_mean_token_mean")
    assert_same_value_and_gradient(ours, gspo_token_paper(logp, old, adv, mask, low, high), logp)
    # by hand, sequence 3 (one valid token, on the unclipped side or not): -A_30 clip-or-not(s_3) / 4
    s_3 = math.exp(float((logp[3, 0] - old[3, 0]).detach()))
    a = float(adv[3, 0])
    expected = -min(s_3 * a, min(max(s_3, 1 - low), 1 + high) * a)
    assert out.per_token[3, 0].item() == pytest.approx(expected)
    # the same advantage on every token of a sequence gives the sequence form's loss
    flat = adv[:, :1].expand(-1, 6)
    same = gspo(logp, old, flat, mask, clip=ClipParams(low, high)).per_token
    torch.testing.assert_close(same, gspo(logp, old, adv[:, 0], mask, clip=ClipParams(low, high)).per_token)


def cispo_paper(logp, old, adv, mask, low, high):  # type: ignore[no-untyped-def]
    """-J_CISPO: sum over every valid token of sg(clip(r)) A log pi, over the number of valid tokens."""
    total, count = torch.zeros((), dtype=F64), 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                r = math.exp(float((logp[i, t] - old[i, t]).detach()))
                weight = min(max(r, 1 - low), 1 + high)
                total = total + weight * adv[i] * logp[i, t]
                count += 1
    return -total / count


@pytest.mark.parametrize(("seed", "low", "high"), [(0, 1.0, 0.28), (1, 0.2, 0.2), (2, 1.0, 0.05)])
def test_cispo_value_and_gradient_are_the_papers(seed: int, low: float, high: float) -> None:
    logp, old, adv, mask = batch(seed)
    out = cispo(logp, old, adv, mask, clip=ClipParams(low, high))
    ours = aggregate(out.per_token, mask, "token_mean")
    assert_same_value_and_gradient(ours, cispo_paper(logp, old, adv, mask, low, high), logp)


def test_cispo_keeps_the_gradient_of_tokens_ppo_clips() -> None:
    logp = torch.log(torch.tensor([[2.0, 0.1]], dtype=F64)).requires_grad_(True)
    old, adv, mask = torch.zeros_like(logp), torch.tensor([1.0], dtype=F64), torch.ones(1, 2)
    clip = ClipParams(1.0, 0.28)
    (g_cispo,) = torch.autograd.grad(cispo(logp, old, adv, mask, clip=clip).per_token.sum(), logp)
    (g_ppo,) = torch.autograd.grad(ppo_clip(logp, old, adv, mask, clip=clip).per_token.sum(), logp)
    assert g_ppo[0, 0].item() == 0.0  # PPO: r = 2 > 1.28 with A > 0 is clipped out
    assert g_cispo[0, 0].item() == pytest.approx(-1.28)  # CISPO: weight 1.28, the token still learns
    assert g_cispo[0, 1].item() == pytest.approx(-0.1)  # no lower bound: weight r = 0.1
    assert cispo(logp, old, adv, mask, clip=clip).stats["clipfrac"].item() == 0.5
