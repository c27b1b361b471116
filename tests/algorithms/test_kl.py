"""KL estimators, KL-shaped rewards and KL controllers."""

import math

import pytest
import torch

from trainer.algorithms.kl import KL_ESTIMATORS, abs_kl, get_kl_estimator, k1, k2, k3, kl_penalized_rewards
from trainer.algorithms.kl_control import KL_CONTROLLERS, AdaptiveKL, FixedKL, get_kl_controller

F64 = torch.float64


def test_estimators_hand_values() -> None:
    # log pi = log 0.5, log pi_ref = log 0.25: log r = ln 2.
    logp = torch.tensor([[math.log(0.5)]], dtype=F64)
    ref = torch.tensor([[math.log(0.25)]], dtype=F64)
    ln2 = math.log(2.0)
    torch.testing.assert_close(k1(logp, ref), torch.tensor([[ln2]], dtype=F64))
    torch.testing.assert_close(k2(logp, ref), torch.tensor([[0.5 * ln2**2]], dtype=F64))
    # k3 = pi_ref/pi - 1 - log(pi_ref/pi) = 0.5 - 1 + ln 2
    torch.testing.assert_close(k3(logp, ref), torch.tensor([[ln2 - 0.5]], dtype=F64))
    torch.testing.assert_close(abs_kl(ref, logp), torch.tensor([[ln2]], dtype=F64))


def test_estimators_are_unbiased_or_not_as_documented() -> None:
    # Exact expectations over a 3-token vocabulary, sampling from pi: E[k1] = E[k3] = KL(pi || pi_ref).
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    ref = torch.tensor([0.2, 0.2, 0.6], dtype=F64)
    kl = (pi * (pi / ref).log()).sum()
    lp, lr = pi.log().unsqueeze(0), ref.log().unsqueeze(0)
    torch.testing.assert_close((pi * k1(lp, lr)[0]).sum(), kl)
    torch.testing.assert_close((pi * k3(lp, lr, clamp=None)[0]).sum(), kl)
    assert not torch.isclose((pi * k2(lp, lr)[0]).sum(), kl)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k3_non_negative(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(4, 50, generator=g, dtype=F64) * 3
    ref = torch.randn(4, 50, generator=g, dtype=F64) * 3
    assert (k3(logp, ref, clamp=None) >= 0).all()
    assert (k3(logp, ref) >= 0).all() and (k2(logp, ref) >= 0).all() and (abs_kl(logp, ref) >= 0).all()


def test_k3_clamp() -> None:
    logp = torch.tensor([[0.0, 0.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[50.0, 1.0]], dtype=F64)
    out = k3(logp, ref)
    assert out[0, 0].item() == 10.0
    torch.testing.assert_close(out[0, 1], torch.tensor(math.e - 2.0, dtype=F64))
    (g,) = torch.autograd.grad(out.sum(), logp)
    assert torch.isfinite(g).all() and g[0, 0].item() == 0.0
    assert k3(logp, ref, clamp=None)[0, 0].item() == pytest.approx(math.exp(50.0) - 51.0)


def test_kl_penalized_rewards_hand_value() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -3.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    scores = torch.tensor([2.0, -1.0, 7.0], dtype=F64)
    out = kl_penalized_rewards(scores, logp, ref, mask, kl_coef=0.1)
    # row 0: k1 = [0.5, -1.0] -> -0.1 * k1 = [-0.05, 0.1]; score on token 1; padding 0.
    expected = torch.tensor([[-0.05, 0.1 + 2.0, 0.0], [0.0, 0.0, -1.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(out, expected)
    out_k2 = kl_penalized_rewards(scores, logp, ref, mask, kl_coef=0.1, estimator="k2")
    torch.testing.assert_close(out_k2[0, :2], torch.tensor([-0.0125, -0.05 + 2.0], dtype=F64))


def test_kl_penalized_rewards_with_holes_credits_last_valid_token() -> None:
    z = torch.zeros(1, 4, dtype=F64)
    out = kl_penalized_rewards(
        torch.tensor([3.0], dtype=F64), z, z, torch.tensor([[1, 0, 1, 0]]), kl_coef=1.0
    )
    assert out.tolist() == [[0.0, 0.0, 3.0, 0.0]]


def test_kl_registry() -> None:
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "abs"}
    assert get_kl_estimator("abs") is abs_kl
    with pytest.raises(ValueError, match="abs, k1, k2, k3"):
        get_kl_estimator("low_var_kl")
    with pytest.raises(ValueError, match="k1"):
        kl_penalized_rewards(
            torch.zeros(1),
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1, 1),
            kl_coef=0.1,
            estimator="k4",
        )


def test_fixed_kl() -> None:
    c = FixedKL(0.05)
    c.update(current_kl=100.0, n_steps=64)
    assert c.value == 0.05


def test_adaptive_kl_hand_values() -> None:
    c = AdaptiveKL(init_coef=0.1, target=6.0, horizon=10000)
    c.update(current_kl=9.0, n_steps=256)  # error clip(0.5) = 0.2 -> x (1 + 0.2 * 256 / 10000)
    assert c.value == pytest.approx(0.1 * 1.00512)
    c.update(current_kl=5.4, n_steps=1000)  # error -0.1 -> x (1 - 0.01)
    assert c.value == pytest.approx(0.1 * 1.00512 * 0.99)
    c.update(current_kl=6.0, n_steps=1000)
    assert c.value == pytest.approx(0.1 * 1.00512 * 0.99)


def test_adaptive_kl_converges_towards_target_direction() -> None:
    c = AdaptiveKL(init_coef=1.0, target=1.0, horizon=10)
    for _ in range(5):
        c.update(current_kl=0.0, n_steps=1)  # KL far below target: coefficient shrinks by 2 % a step
    assert c.value == pytest.approx(0.98**5)


def test_adaptive_kl_refuses_bad_params() -> None:
    with pytest.raises(ValueError):
        AdaptiveKL(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError):
        AdaptiveKL(0.1, target=1.0, horizon=0)


def test_kl_controller_registry() -> None:
    assert set(KL_CONTROLLERS) == {"fixed", "adaptive"}
    fixed = KL_CONTROLLERS["fixed"](init_coef=0.2, target=6.0, horizon=100)
    adaptive = get_kl_controller("adaptive")(init_coef=0.2, target=6.0, horizon=100)
    assert isinstance(fixed, FixedKL) and isinstance(adaptive, AdaptiveKL)
    assert fixed.value == adaptive.value == 0.2
    with pytest.raises(ValueError, match="adaptive, fixed"):
        get_kl_controller("linear")
