"""SimPO and ORPO against independent transcriptions of the papers' objectives (plain Python floats, no
torch in the oracle), at hand-picked and random points, and their gradients' direction."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trainer.algorithms.preference_losses import PreferenceParams, log_odds, orpo_odds_ratio, simpo

F64 = torch.float64


def neg_log_sigmoid(x: float) -> float:
    return math.log1p(math.exp(-x)) if x > -30 else -x


def simpo_paper(logp_w: float, len_w: int, logp_l: float, len_l: int, beta: float, gamma: float) -> float:
    """Meng et al. 2024, eq. 6: -log sigma(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) - gamma)."""
    return neg_log_sigmoid(beta / len_w * logp_w - beta / len_l * logp_l - gamma)


def orpo_paper(logp_w: float, len_w: int, logp_l: float, len_l: int, lam: float) -> tuple[float, float]:
    """Hong et al. 2024, eqs. 4-7: P = exp(mean token log-prob); odds = P / (1 - P);
    L_OR = -log sigma(log(odds_w / odds_l)); L = L_SFT + lambda L_OR with L_SFT = -mean token log-prob."""
    p_w, p_l = math.exp(logp_w / len_w), math.exp(logp_l / len_l)
    odds_w, odds_l = p_w / (1 - p_w), p_l / (1 - p_l)
    l_or = neg_log_sigmoid(math.log(odds_w / odds_l))
    return -logp_w / len_w + lam * l_or, lam * l_or


def test_simpo_matches_the_paper_at_random_points() -> None:
    rng = random.Random(0)
    for _ in range(50):
        len_w, len_l = rng.randint(1, 40), rng.randint(1, 40)
        logp_w, logp_l = -rng.uniform(0.1, 3) * len_w, -rng.uniform(0.1, 3) * len_l
        beta, gamma = rng.uniform(0.5, 3), rng.uniform(0, 2)
        got = simpo(
            torch.tensor([logp_w / len_w], dtype=F64),
            torch.tensor([logp_l / len_l], dtype=F64),
            PreferenceParams(beta=beta, gamma=gamma),
        )
        assert got.item() == pytest.approx(simpo_paper(logp_w, len_w, logp_l, len_l, beta, gamma), rel=1e-12)


def test_simpo_at_equal_likelihoods_is_log_of_one_plus_e_gamma() -> None:
    got = simpo(torch.tensor([-1.0]), torch.tensor([-1.0]), PreferenceParams(beta=2.0, gamma=0.5))
    assert got.item() == pytest.approx(math.log(1 + math.exp(0.5)))


def test_orpo_matches_the_paper_at_random_points() -> None:
    rng = random.Random(1)
    for _ in range(50):
        len_w, len_l = rng.randint(1, 40), rng.randint(1, 40)
        logp_w, logp_l = -rng.uniform(0.05, 4) * len_w, -rng.uniform(0.05, 4) * len_l
        lam = rng.uniform(0.05, 1)
        _, expected_or = orpo_paper(logp_w, len_w, logp_l, len_l, lam)
        got = orpo_odds_ratio(
            torch.tensor([logp_w / len_w], dtype=F64),
            torch.tensor([logp_l / len_l], dtype=F64),
            PreferenceParams(beta=lam),
        )
        assert got.item() == pytest.approx(expected_or, rel=1e-9)


def test_log_odds_is_stable_near_certainty_and_far_from_it() -> None:
    x = torch.tensor([-1e-4, -1e-8, -50.0, -700.0], dtype=F64)
    expected = [v - math.log(-math.expm1(v)) for v in (-1e-4, -1e-6, -50.0, -700.0)]  # -1e-8 clamps to -1e-6
    torch.testing.assert_close(log_odds(x), torch.tensor(expected, dtype=F64))
    assert torch.isfinite(log_odds(torch.tensor([0.0]))).all()


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_the_gradient_raises_the_chosen_and_lowers_the_rejected(loss: str) -> None:
    c = torch.tensor([-1.2], dtype=F64, requires_grad=True)
    r = torch.tensor([-0.9], dtype=F64, requires_grad=True)
    fn = simpo if loss == "simpo" else orpo_odds_ratio
    fn(c, r, PreferenceParams(beta=2.0 if loss == "simpo" else 0.1, gamma=0.5)).sum().backward()
    assert c.grad is not None and r.grad is not None
    assert c.grad.item() < 0 < r.grad.item()  # descending the loss raises c and lowers r
