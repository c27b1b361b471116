"""KTO's loss and reference point against an independent transcription of Ethayarajh et al. 2024, eq. 8
(plain Python floats), at random points, and their gradient's direction."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trainer.algorithms.preference_losses import KtoParams, kto, kto_reference_point

F64 = torch.float64


def sigma(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def kto_paper(r: float, desirable: bool, z0: float, beta: float, lam_d: float, lam_u: float) -> float:
    """L = lambda_y - v(x, y); v = lambda_D sigma(beta (r - z0)) or lambda_U sigma(beta (z0 - r))."""
    if desirable:
        return lam_d - lam_d * sigma(beta * (r - z0))
    return lam_u - lam_u * sigma(beta * (z0 - r))


def test_kto_matches_the_paper_at_random_points() -> None:
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 12)
        r = [rng.uniform(-20, 20) for _ in range(n)]
        d = [rng.random() < 0.5 for _ in range(n)]
        z0 = rng.uniform(0, 5)
        p = KtoParams(
            beta=rng.uniform(0.01, 1),
            desirable_weight=rng.uniform(0.5, 2),
            undesirable_weight=rng.uniform(0.5, 2),
        )
        got = kto(torch.tensor(r, dtype=F64), torch.tensor(d), torch.tensor(z0, dtype=F64), p)
        expected = [
            kto_paper(ri, di, z0, p.beta, p.desirable_weight, p.undesirable_weight)
            for ri, di in zip(r, d, strict=True)
        ]
        torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=1e-12)


def test_at_the_reference_point_each_loss_is_half_its_weight() -> None:
    got = kto(
        torch.tensor([2.0, 2.0]), torch.tensor([True, False]), torch.tensor(2.0), KtoParams(0.1, 1.0, 1.5)
    )
    torch.testing.assert_close(got, torch.tensor([0.5, 0.75]))


def test_the_reference_point_is_the_clamped_mean_kl_without_gradient() -> None:
    policy = torch.tensor([-3.0, -1.0, -2.5], requires_grad=True)
    reference = torch.tensor([-2.0, -2.0, -2.0])
    z0 = kto_reference_point(policy, reference)
    assert z0.item() == pytest.approx(max(0.0, ((-1.0) + 1.0 + (-0.5)) / 3)) and not z0.requires_grad
    assert kto_reference_point(torch.tensor([-5.0]), torch.tensor([-1.0])).item() == 0.0  # clamped at 0
    assert kto_reference_point(torch.zeros(0), torch.zeros(0)).item() == 0.0


def test_the_gradient_raises_desirable_and_lowers_undesirable_answers() -> None:
    r = torch.tensor([0.3, 0.3], dtype=F64, requires_grad=True)
    kto(r, torch.tensor([True, False]), torch.tensor(0.1, dtype=F64), KtoParams()).sum().backward()
    assert r.grad is not None and r.grad[0] < 0 < r.grad[1]
