"""Policy losses (PPO clip, dual-clip, vanilla), truncated IS weights and the value loss."""

import math

import pytest
import torch

from trainer.algorithms.policy_losses import (
    POLICY_LOSSES,
    ClipParams,
    get_policy_loss,
    ppo_clip,
    truncated_is_weights,
    vanilla,
)
from trainer.algorithms.value_losses import value_loss

F64 = torch.float64


def lp(*ratios: float) -> torch.Tensor:
    """(1, n) log-probs whose ratio to old_logp = 0 is the given ratio."""
    return torch.tensor([[math.log(r) for r in ratios]], dtype=F64, requires_grad=True)


def row(*xs: float) -> torch.Tensor:
    return torch.tensor([list(xs)], dtype=F64)


def test_ppo_clip_hand_values() -> None:
    logp = lp(1.5, 1.5, 0.5, 0.5, 1.0)
    adv = row(1.0, -1.0, 1.0, -1.0, 2.0)
    out = ppo_clip(logp, torch.zeros_like(logp), adv, torch.ones(1, 5), clip=ClipParams(0.2, 0.2))
    # r=1.5,A=+1: max(-1.5, -1.2) = -1.2 (clipped); r=1.5,A=-1: max(1.5, 1.2) = 1.5;
    # r=0.5,A=+1: max(-0.5, -0.8) = -0.5;            r=0.5,A=-1: max(0.5, 0.8) = 0.8 (clipped); r=1: -2
    torch.testing.assert_close(out.per_token, row(-1.2, 1.5, -0.5, 0.8, -2.0))
    torch.testing.assert_close(out.stats["clipfrac"], torch.tensor(2 / 5, dtype=F64))
    k3 = [(r - 1) - math.log(r) for r in (1.5, 1.5, 0.5, 0.5, 1.0)]
    torch.testing.assert_close(out.stats["approx_kl"], torch.tensor(sum(k3) / 5, dtype=F64))
    assert "dual_clipfrac" not in out.stats
    assert all(not v.requires_grad for v in out.stats.values())


def test_clip_higher_is_asymmetric() -> None:
    logp = lp(1.25, 0.75)
    out = ppo_clip(logp, torch.zeros_like(logp), row(1.0, -1.0), torch.ones(1, 2), clip=ClipParams(0.2, 0.28))
    # r=1.25 < 1.28 is not clipped for A>0; r=0.75 < 0.8 is clipped for A<0.
    torch.testing.assert_close(out.per_token, row(-1.25, 0.8))


def test_dual_clip_hand_values() -> None:
    logp = lp(4.0, 2.0, 4.0)
    adv = row(-1.0, -1.0, 1.0)
    out = ppo_clip(logp, torch.zeros_like(logp), adv, torch.ones(1, 3), clip=ClipParams(0.2, 0.2, dual_c=3.0))
    # A=-1, r=4: PPO gives 4, capped at c*|A| = 3; r=2: 2 < 3 unchanged; A>0 never capped: -1.2.
    torch.testing.assert_close(out.per_token, row(3.0, 2.0, -1.2))
    torch.testing.assert_close(out.stats["dual_clipfrac"], torch.tensor(1 / 3, dtype=F64))
    (g,) = torch.autograd.grad(out.per_token.sum(), logp)
    assert g[0, 0].item() == 0.0 and g[0, 1].item() == pytest.approx(2.0)


def test_ppo_gradient_at_ratio_one_equals_vanilla_pg() -> None:
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 6, generator=g, dtype=F64)
    adv = torch.randn(3, 6, generator=g, dtype=F64)
    mask = torch.rand(3, 6, generator=g) > 0.3
    logp = old.clone().requires_grad_(True)
    (g_ppo,) = torch.autograd.grad(ppo_clip(logp, old, adv, mask, clip=ClipParams()).per_token.sum(), logp)
    # REINFORCE: d/d logp of -A * logp on valid tokens.
    (g_pg,) = torch.autograd.grad((-adv * logp * mask).sum(), logp)
    torch.testing.assert_close(g_ppo, g_pg)
    (g_van,) = torch.autograd.grad(vanilla(logp, old, adv, mask, clip=ClipParams()).per_token.sum(), logp)
    torch.testing.assert_close(g_van, g_pg)


def test_ppo_gradient_zero_past_the_clip_on_improving_side() -> None:
    logp = lp(1.5, 0.5, 0.5, 1.5)
    adv = row(1.0, -1.0, 1.0, -1.0)
    out = ppo_clip(logp, torch.zeros_like(logp), adv, torch.ones(1, 4), clip=ClipParams(0.2, 0.2))
    (g,) = torch.autograd.grad(out.per_token.sum(), logp)
    # improving side past the clip: 0; the other side keeps the unclipped gradient -A * r.
    torch.testing.assert_close(g, row(0.0, 0.0, -0.5, 1.5))


def test_vanilla_is_unclipped() -> None:
    logp = lp(1.5, 0.5)
    out = vanilla(logp, torch.zeros_like(logp), row(1.0, -1.0), torch.ones(1, 2), clip=ClipParams(0.2, 0.2))
    torch.testing.assert_close(out.per_token, row(-1.5, 0.5))
    (g,) = torch.autograd.grad(out.per_token.sum(), logp)
    torch.testing.assert_close(g, row(-1.5, 0.5))
    torch.testing.assert_close(
        out.stats["clipfrac"], torch.tensor(1.0, dtype=F64)
    )  # ppo_clip would clip both


@pytest.mark.parametrize("name", ["ppo_clip", "vanilla"])
def test_sequence_advantage_broadcasts_and_mask_zeroes(name: str) -> None:
    logp = torch.tensor([[0.1, float("nan")], [0.2, 0.3]], dtype=F64)
    mask = torch.tensor([[1, 0], [0, 0]])
    out = POLICY_LOSSES[name](
        logp, torch.zeros_like(logp), torch.tensor([2.0, 3.0], dtype=F64), mask, clip=ClipParams(dual_c=3.0)
    )
    assert out.per_token[0, 1].item() == 0.0 and out.per_token[1].tolist() == [0.0, 0.0]
    ratio = math.exp(0.1)
    expected = -2.0 * ratio if name == "vanilla" else -2.0 * min(ratio, 1.2)
    assert out.per_token[0, 0].item() == pytest.approx(expected)
    assert all(torch.isfinite(v) for v in out.stats.values())


def test_fully_masked_stats_are_zero() -> None:
    z = torch.zeros(2, 3, dtype=F64)
    out = ppo_clip(z, z, z, torch.zeros(2, 3), clip=ClipParams(dual_c=2.0))
    assert {k: v.item() for k, v in out.stats.items()} == {
        "clipfrac": 0.0,
        "approx_kl": 0.0,
        "dual_clipfrac": 0.0,
    }


def test_clip_params_validation() -> None:
    with pytest.raises(ValueError):
        ClipParams(low=1.01)
    with pytest.raises(ValueError):
        ClipParams(low=-0.1)
    assert ClipParams(low=1.0).low == 1.0  # no lower bound (CISPO's paper)
    with pytest.raises(ValueError):
        ClipParams(high=0.0)
    with pytest.raises(ValueError):
        ClipParams(dual_c=1.0)


def test_policy_loss_registry() -> None:
    assert set(POLICY_LOSSES) == {"ppo_clip", "vanilla", "gspo", "cispo"}
    assert get_policy_loss("ppo_clip") is ppo_clip
    with pytest.raises(ValueError, match="ppo_clip, vanilla"):
        get_policy_loss("dual_clip")


def test_truncated_is_weights() -> None:
    trainer = torch.tensor([[0.0, math.log(3.0), math.log(0.5), 1.0]], dtype=F64, requires_grad=True)
    rollout = torch.zeros(1, 4, dtype=F64)
    w = truncated_is_weights(trainer, rollout, torch.tensor([[1, 1, 1, 0]]), cap=2.0)
    torch.testing.assert_close(w, row(1.0, 2.0, 0.5, 0.0))
    assert not w.requires_grad


def test_value_loss_hand_values() -> None:
    values = torch.tensor([[1.5, 0.0, 2.0, 9.0]], dtype=F64, requires_grad=True)
    old = row(1.0, 1.0, 1.0, 0.0)
    returns = row(1.0, 2.0, 1.2, 0.0)
    mask = torch.tensor([[1, 1, 1, 0]])
    out = value_loss(values, old, returns, mask, clip_range=0.2)
    # t0: V 1.5 -> clipped 1.2; max(0.25, 0.04) = 0.25 -> 0.125
    # t1: V 0 -> clipped 0.8; max(4, 1.44) = 4 -> 2
    # t2: V 2 -> clipped 1.2; max(0.64, 0) = 0.64 -> 0.32;  t3 masked
    torch.testing.assert_close(out, row(0.125, 2.0, 0.32, 0.0))
    unclipped = value_loss(values, old, returns, mask, clip_range=None)
    torch.testing.assert_close(unclipped, row(0.125, 2.0, 0.32, 0.0))
    # Clipped term active: V moved past old + eps towards a target beyond it -> no gradient.
    v2 = torch.tensor([[1.5]], dtype=F64, requires_grad=True)
    out2 = value_loss(v2, row(1.0), row(3.0), torch.ones(1, 1), clip_range=0.2)
    # unclipped (1.5-3)^2 = 2.25 < clipped (1.2-3)^2 = 3.24 -> 0.5 * 3.24, constant in V
    torch.testing.assert_close(out2, torch.tensor([[1.62]], dtype=F64))
    (g,) = torch.autograd.grad(out2.sum(), v2)
    assert g.item() == 0.0
