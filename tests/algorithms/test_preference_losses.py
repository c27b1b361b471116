"""DPO-family, Bradley-Terry and K-wise losses: hand values, a pair-loop oracle and gradient direction."""

import itertools
import math

import pytest
import torch

from trainer.algorithms.logprobs import token_logprobs
from trainer.algorithms.preference_losses import (
    PREFERENCE_LOSSES,
    PreferenceParams,
    bradley_terry,
    cdpo,
    chosen_nll,
    get_preference_loss,
    hinge,
    ipo,
    kwise_ranking,
    robust,
    sigmoid,
)

F64 = torch.float64


def sp(x: float) -> float:
    """softplus(-x) = -log sigmoid(x), in plain floats."""
    return math.log1p(math.exp(-x))


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


def test_registry_keys() -> None:
    assert set(PREFERENCE_LOSSES) == {"sigmoid", "cdpo", "robust", "ipo", "hinge", "simpo"}


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="cdpo, hinge, ipo, robust, sigmoid, simpo"):
        get_preference_loss("dpo")
    assert get_preference_loss("ipo") is ipo


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        PREFERENCE_LOSSES["x"] = sigmoid  # type: ignore[index]


def test_sigmoid_at_zero_is_log2() -> None:
    out = sigmoid(t(0.0, 3.0), t(0.0, 3.0), PreferenceParams(beta=0.1))
    torch.testing.assert_close(out, t(math.log(2.0), math.log(2.0)))


def test_sigmoid_hand_value() -> None:
    # beta * (c - r) = 0.5 * (1.5 - (-0.5)) = 1
    out = sigmoid(t(1.5), t(-0.5), PreferenceParams(beta=0.5, label_smoothing=0.3))
    torch.testing.assert_close(out, t(sp(1.0)))  # label_smoothing ignored


def test_cdpo_hand_value() -> None:
    p = PreferenceParams(beta=1.0, label_smoothing=0.1)
    out = cdpo(t(1.0, 0.0), t(0.0, 0.0), p)
    torch.testing.assert_close(out, t(0.9 * sp(1.0) + 0.1 * sp(-1.0), math.log(2.0)))
    # sp(-1) - sp(1) = 1 exactly, so 0.9 sp(1) + 0.1 sp(-1) = sp(1) + 0.1.
    torch.testing.assert_close(out[0], torch.tensor(0.3132616875182228 + 0.1, dtype=F64))


def test_cdpo_eps_zero_equals_sigmoid_and_half_ignores_the_label() -> None:
    c, r = t(0.3, -2.0), t(1.0, 0.5)
    p0 = PreferenceParams(beta=0.7)
    torch.testing.assert_close(cdpo(c, r, p0), sigmoid(c, r, p0))
    half = PreferenceParams(beta=0.7, label_smoothing=0.5)
    torch.testing.assert_close(cdpo(c, r, half), cdpo(r, c, half))
    assert not torch.allclose(cdpo(c, r, p0), cdpo(r, c, p0))


def test_robust_hand_value() -> None:
    p = PreferenceParams(beta=1.0, label_smoothing=0.1)
    out = robust(t(1.0), t(0.0), p)
    torch.testing.assert_close(out, t((0.9 * sp(1.0) - 0.1 * sp(-1.0)) / 0.8))
    torch.testing.assert_close(out, t(0.1882616875182228))


def test_robust_is_unbiased_under_flips() -> None:
    # E over label flips (prob eps) of the rDPO loss equals the clean DPO loss.
    eps, c, r = 0.2, t(0.8), t(-0.3)
    p = PreferenceParams(beta=1.3, label_smoothing=eps)
    expected = (1 - eps) * robust(c, r, p) + eps * robust(r, c, p)
    torch.testing.assert_close(expected, sigmoid(c, r, p))


def test_robust_refuses_eps_half() -> None:
    with pytest.raises(ValueError, match="0.5"):
        robust(t(1.0), t(0.0), PreferenceParams(label_smoothing=0.5))


def test_ipo_hand_values() -> None:
    p = PreferenceParams(beta=0.5)  # target margin 1 / (2 * 0.5) = 1
    torch.testing.assert_close(ipo(t(3.0, 0.0, 1.5), t(0.0, 0.0, 0.5), p), t(4.0, 1.0, 0.0))


def test_hinge_hand_values() -> None:
    p = PreferenceParams(beta=0.5)
    torch.testing.assert_close(hinge(t(1.0, 4.0, -2.0), t(0.0, 0.0, 0.0), p), t(0.5, 0.0, 2.0))


@pytest.mark.parametrize("name", ["sigmoid", "cdpo", "robust", "ipo", "hinge"])
def test_gradient_raises_chosen_logprob(name: str) -> None:
    # One SGD step on free logits: the chosen completion's log-prob must go up, rejected down.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=F64).requires_grad_(True)
    chosen, rejected = torch.tensor([[1, 2, 3]]), torch.tensor([[4, 0, 1]])
    ref_c, ref_r = torch.tensor([-4.0], dtype=F64), torch.tensor([-4.0], dtype=F64)
    p = PreferenceParams(beta=0.1, label_smoothing=0.1)

    def logps(lg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(lg[:1], chosen).sum(-1), token_logprobs(lg[1:], rejected).sum(-1)

    before_c, before_r = logps(logits)
    loss = PREFERENCE_LOSSES[name](before_c - ref_c, before_r - ref_r, p).sum()
    (grad,) = torch.autograd.grad(loss, logits)
    after_c, after_r = logps(logits.detach() - 1.0 * grad)
    assert after_c.item() > before_c.item()
    assert after_r.item() < before_r.item()


def test_bradley_terry_hand_values() -> None:
    torch.testing.assert_close(bradley_terry(t(2.0, 0.5), t(1.0, 0.5)), t(sp(1.0), math.log(2.0)))
    # margin 1 cancels the gap; centring adds 0.5 * (2 + 1)^2 = 4.5.
    out = bradley_terry(t(2.0), t(1.0), margin=t(1.0), center_coef=0.5)
    torch.testing.assert_close(out, t(math.log(2.0) + 4.5))


def test_kwise_hand_value() -> None:
    out = kwise_ranking(torch.tensor([[3.0, 1.0, 0.0]], dtype=F64))
    torch.testing.assert_close(out, t((sp(2.0) + sp(3.0) + sp(1.0)) / 3))


def test_kwise_two_equals_bradley_terry() -> None:
    s = torch.tensor([[0.4, -1.0], [2.0, 3.0]], dtype=F64)
    torch.testing.assert_close(kwise_ranking(s), bradley_terry(s[:, 0], s[:, 1]))


def kwise_oracle(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = []
    for row, m in zip(scores.tolist(), mask.tolist(), strict=True):
        valid = [s for s, keep in zip(row, m, strict=True) if keep]
        pairs = list(itertools.combinations(range(len(valid)), 2))
        out.append(sum(sp(valid[i] - valid[j]) for i, j in pairs) / len(pairs) if pairs else 0.0)
    return torch.tensor(out, dtype=F64)


@pytest.mark.parametrize(("B", "K", "seed"), [(1, 2, 0), (3, 4, 1), (5, 6, 2), (8, 3, 3)])
def test_kwise_matches_loop_oracle(B: int, K: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, K, generator=g, dtype=F64) * 2
    mask = torch.rand(B, K, generator=g) > 0.3
    mask[0] = True
    torch.testing.assert_close(kwise_ranking(scores, mask), kwise_oracle(scores, mask), rtol=1e-6, atol=1e-6)
    full = torch.ones(B, K, dtype=torch.bool)
    torch.testing.assert_close(kwise_ranking(scores), kwise_oracle(scores, full), rtol=1e-6, atol=1e-6)


def test_kwise_fewer_than_two_valid_is_zero_without_nan() -> None:
    scores = torch.tensor([[1.0, float("nan"), 2.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, False, False]])
    out = kwise_ranking(scores, mask)
    (g,) = torch.autograd.grad(out.sum(), scores)
    assert out.tolist() == [0.0]
    assert not torch.isnan(g).any()


def test_chosen_nll_is_each_pairs_nll_per_token() -> None:
    """-log pi(y_w|x) / |y_w| by hand; a zero count is taken as 1 (never a division by zero)."""
    got = chosen_nll(torch.tensor([-6.0, -2.0, -3.0]), torch.tensor([3.0, 1.0, 0.0]))
    assert got.tolist() == [2.0, 2.0, 3.0]
