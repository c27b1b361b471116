"""Trainer/sampler mismatch statistics and truncated importance sampling, against hand-derived values."""

import math

import pytest
import torch

from trainer.algorithms.sampler_correction import importance_ratio, mismatch_stats, truncated_is_weights

F64 = torch.float64


def logs(*probs: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]], dtype=F64)


def test_ratio_and_truncated_weights_hand_values() -> None:
    # pi_old = (0.5, 0.2, 0.3), pi_sampler = (0.25, 0.4, 0.3): ratios 2, 0.5, 1
    old, sampler = logs(0.5, 0.2, 0.3), logs(0.25, 0.4, 0.3)
    torch.testing.assert_close(
        importance_ratio(old, sampler).double(), torch.tensor([[2.0, 0.5, 1.0]], dtype=F64)
    )
    # cap 1.5 cuts only the first
    got = truncated_is_weights(old, sampler, cap=1.5).double()
    torch.testing.assert_close(got, torch.tensor([[1.5, 0.5, 1.0]], dtype=F64))
    # a cap above every ratio changes nothing
    torch.testing.assert_close(
        truncated_is_weights(old, sampler, cap=10.0).double(), importance_ratio(old, sampler).double()
    )


def test_weights_carry_no_gradient() -> None:
    old = logs(0.5, 0.2).requires_grad_(True)
    assert not truncated_is_weights(old, logs(0.25, 0.4), cap=2.0).requires_grad


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_is_weights(logs(0.5), logs(0.5), cap=0.5)


def test_an_impossible_token_gives_a_large_finite_ratio() -> None:
    old = torch.tensor([[0.0, -1e9]])
    sampler = torch.tensor([[-1e9, 0.0]])
    rho = importance_ratio(old, sampler)
    assert torch.isfinite(rho).all() and rho[0, 0] > 1e8 and rho[0, 1] < 1e-8


def test_mismatch_stats_hand_values_over_the_masked_tokens() -> None:
    # counted tokens: ratios 2 and 0.5; the third token (ratio 100) is masked out
    old = logs(0.5, 0.2, 1.0)
    sampler = logs(0.25, 0.4, 0.01)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    got = {k: float(v) for k, v in mismatch_stats(old, sampler, mask, cap=1.5).items()}
    ln2 = math.log(2.0)
    expected = {
        "mismatch/logp_abs_diff": ln2,  # |ln 2| and |ln 0.5|
        "mismatch/ratio_mean": 1.25,  # (2 + 0.5) / 2
        "mismatch/ratio_min": 0.5,
        "mismatch/ratio_max": 2.0,
        "mismatch/ratio_std": 0.75,  # population std of {2, 0.5}
        # k3 of KL(sampler || old): (2 - 1 - ln 2 + 0.5 - 1 + ln 2) / 2
        "mismatch/kl": 0.25,
        "mismatch/capped_frac": 0.5,  # only the ratio 2 exceeds 1.5
    }
    assert got == pytest.approx(expected, abs=1e-6)  # float32 statistics
    assert "mismatch/capped_frac" not in mismatch_stats(old, sampler, mask)  # no cap: no capped share


def test_the_kl_stat_estimates_the_exact_kl_in_expectation() -> None:
    # E_{y ~ sampler}[rho - 1 - log rho] = KL(sampler || old), exactly, over a 3-token vocabulary
    sampler_p = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    old_p = torch.tensor([0.4, 0.4, 0.2], dtype=F64)
    exact = float((sampler_p * (sampler_p / old_p).log()).sum())
    per_token = {
        k: float(
            mismatch_stats(old_p[k].log().view(1, 1), sampler_p[k].log().view(1, 1), torch.ones(1, 1))[
                "mismatch/kl"
            ]
        )
        for k in range(3)
    }
    assert sum(float(sampler_p[k]) * v for k, v in per_token.items()) == pytest.approx(exact, abs=1e-6)


def test_equal_log_probs_show_no_mismatch_and_an_empty_mask_gives_neutral_stats() -> None:
    same = logs(0.3, 0.6)
    got = mismatch_stats(same, same.clone(), torch.ones(1, 2), cap=2.0)
    assert float(got["mismatch/logp_abs_diff"]) == 0 and float(got["mismatch/ratio_max"]) == 1
    assert float(got["mismatch/kl"]) == 0 and float(got["mismatch/capped_frac"]) == 0
    empty = mismatch_stats(logs(0.5), logs(0.1), torch.zeros(1, 1), cap=2.0)
    assert {k: float(v) for k, v in empty.items()} == {
        "mismatch/logp_abs_diff": 0.0,
        "mismatch/ratio_mean": 1.0,
        "mismatch/ratio_min": 1.0,
        "mismatch/ratio_max": 1.0,
        "mismatch/ratio_std": 0.0,
        "mismatch/kl": 0.0,
        "mismatch/capped_frac": 0.0,
    }
