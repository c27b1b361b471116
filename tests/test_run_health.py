"""RunHealth rules: each code fires at the hand-derived step, near-misses stay silent, once per run."""

from __future__ import annotations

import math

import pytest

from rlrun.schemas import HEALTH_CODES as SCHEMA_CODES
from trainer.run_health import FLAT, KL_LIMIT, WARNING_CODES, WINDOW, RunHealth, RunWarning

NAN, INF = math.nan, math.inf


def feed(
    steps: list[dict[str, float]], *, window: int = WINDOW, kl_limit: float = KL_LIMIT
) -> list[RunWarning]:
    """Observe ``steps`` as steps 1, 2, ...; return every warning fired."""
    health = RunHealth(window=window, kl_limit=kl_limit)
    return [w for i, m in enumerate(steps, start=1) for w in health.observe(i, m)]


def fired(
    steps: list[dict[str, float]], *, window: int = WINDOW, kl_limit: float = KL_LIMIT
) -> list[tuple[str, int]]:
    return [(w.code, w.step) for w in feed(steps, window=window, kl_limit=kl_limit)]


def test_zero_advantage_fires_at_third_zero_step() -> None:
    # 1 not zero | 2 frac=1 -> 1 | 3 adv/std=0 -> 2 | 4 absent: no change | 5 |adv/std| <= FLAT -> 3: fires.
    steps = [
        {"groups/zero_variance_frac": 0.5, "adv/std": 0.8},
        {"groups/zero_variance_frac": 1.0},
        {"adv/std": 0.0},
        {"loss": 0.3},
        {"groups/zero_variance_frac": 0.2, "adv/std": -1e-7},
    ]
    (w,) = feed(steps)
    assert (w.code, w.step) == ("zero_advantage", 5)
    assert "groups/zero_variance_frac=1" in w.message and "adv/std=-1e-07" in w.message
    assert "step 2" in w.message and "step 5" in w.message


def test_zero_advantage_near_misses() -> None:
    zero, good = {"groups/zero_variance_frac": 1.0}, {"groups/zero_variance_frac": 0.9, "adv/std": 0.3}
    assert fired([zero, zero, good, zero, zero]) == []  # broken by one good step
    assert fired([zero, zero]) == []  # window - 1 steps only
    assert fired([{"adv/std": 2 * FLAT}] * 5) == []  # just above FLAT is not zero


def test_reward_collapse_fires_after_rewards_varied() -> None:
    # 1 std=0.5 varied | 2 flat -> 1 | 3 absent | 4 flat -> 2 | 5 std=1e-7 flat -> 3: fires at 5.
    steps = [
        {"reward/std": 0.5, "reward/mean": 0.4},
        {"reward/std": 0.0, "reward/mean": 1.0},
        {"loss": 1.0},
        {"reward/std": 0.0, "reward/mean": 1.0},
        {"reward/std": 1e-7, "reward/mean": 1.0},
    ]
    (w,) = feed(steps)
    assert (w.code, w.step) == ("reward_collapse", 5)
    assert "reward/mean=1" in w.message and "reward/std=1e-07 at step 5" in w.message


def test_reward_collapse_near_misses() -> None:
    flat, varied = {"reward/std": 0.0}, {"reward/std": 0.3}
    assert fired([flat] * 6) == []  # flat from the start: never varied
    assert fired([varied, flat, flat, varied, flat, flat]) == []  # broken by a varied step
    # flat x3 before any variation does not arm the rule; after step 4 varies, 5, 6, 7 fire at 7.
    assert fired([flat, flat, flat, varied, flat, flat, flat]) == [("reward_collapse", 7)]


def test_kl_diverging_fires_at_third_step_above_limit() -> None:
    # 0.5 no | 1.2 -> 1 | 1.5 -> 2 | 1.0 is not > 1.0: reset | 1.1 -> 1 | 1.3 -> 2 | 1.4 -> 3: fires at 7.
    (w,) = feed([{"kl/ref": v} for v in (0.5, 1.2, 1.5, 1.0, 1.1, 1.3, 1.4)])
    assert (w.code, w.step) == ("kl_diverging", 7)
    assert "kl/ref=1.1" in w.message and "kl/ref=1.4 at step 7" in w.message and "kl/ref=1.5" not in w.message


def test_kl_diverging_custom_window_and_limit() -> None:
    # limit 2, window 2: 1.5 no | 2.5 -> 1 | 3.0 -> 2: fires at 3.
    ws = feed([{"kl/ref": v} for v in (1.5, 2.5, 3.0)], window=2, kl_limit=2.0)
    assert [(w.code, w.step) for w in ws] == [("kl_diverging", 3)]
    assert "above 2 nats" in ws[0].message
    assert fired([{"kl/ref": v} for v in (1.5, 1.9, 1.9, 1.9)], kl_limit=2.0) == []
    assert fired([{"kl/ref": 5.0}] * 3, window=4) == []


def test_loss_diverging_fires_at_third_diverging_step() -> None:
    # 1 loss 2.0 lowest 2 | 2 loss 0.5 lowest 0.5, margin max(1, 0.5) = 1 | 3 1.4: 0.9 <= 1 no |
    # 4 1.6: 1.1 > 1 -> 1 | 5 NaN: not counted (nonfinite fires) | 6 2.0 -> 2 | 7 3.0 -> 3: fires at 7.
    ws = feed([{"loss": v} for v in (2.0, 0.5, 1.4, 1.6, NAN, 2.0, 3.0)])
    assert [(w.code, w.step) for w in ws] == [("nonfinite_skipped", 5), ("loss_diverging", 7)]
    msg = ws[1].message
    assert "lowest loss so far, 0.5" in msg and "loss=1.6 at step 4" in msg and "loss=3 at step 7" in msg


def test_loss_diverging_near_misses() -> None:
    # lowest -3 -> margin 3: -0.5, -0.1, 0.0 rise by 2.5, 2.9, 3.0, none > 3.
    assert fired([{"loss": v} for v in (-3.0, -0.5, -0.1, 0.0)]) == []
    # lowest 0.2 -> margin 1: 1.5, 1.5 diverge, 0.9 (0.7) resets, 1.5, 1.5 again: never 3 in a row.
    assert fired([{"loss": v} for v in (0.2, 1.5, 1.5, 0.9, 1.5, 1.5)]) == []
    # a new lowest is never diverging: the drop to 0.1 resets the streak.
    assert fired([{"loss": v} for v in (0.2, 1.5, 1.5, 0.1, 1.5)]) == []


def test_nonfinite_fires_immediately_naming_keys() -> None:
    steps = [{"loss": 1.0}, {"skipped_updates": 0.0}, {"loss": INF, "kl/ref": NAN, "lr": 1e-5}]
    (w,) = feed(steps)
    assert (w.code, w.step) == ("nonfinite_skipped", 3)
    assert "kl/ref=nan" in w.message and "loss=inf" in w.message and "lr" not in w.message


def test_skipped_updates_fire_nonfinite_skipped_once() -> None:
    (w,) = feed([{"skipped_updates": 0.0}, {"skipped_updates": 2.0}, {"skipped_updates": 1.0, "loss": -INF}])
    assert (w.code, w.step) == ("nonfinite_skipped", 2)
    assert "skipped_updates=2" in w.message


def test_nonfinite_values_are_not_counted_by_other_rules() -> None:
    # kl: 1.5 -> 1 | NaN: not counted, no reset | 1.5 -> 2 | -inf not counted | 1.5 -> 3: fires at 5.
    steps = [{"kl/ref": v} for v in (1.5, NAN, 1.5, -INF, 1.5)]
    assert fired(steps) == [("nonfinite_skipped", 2), ("kl_diverging", 5)]
    # a NaN adv/std alongside a finite zero frac: the frac alone decides.
    zero = {"groups/zero_variance_frac": 1.0, "adv/std": NAN}
    assert fired([zero] * 3) == [("nonfinite_skipped", 1), ("zero_advantage", 3)]


def test_each_code_fires_once_and_together_in_code_order() -> None:
    bad = {
        "groups/zero_variance_frac": 1.0,
        "kl/ref": 9.0,
        "reward/std": 0.0,
        "logps/chosen": -30.0,
        "skipped_updates": 1.0,
    }
    steps = [{"reward/std": 1.0, "loss": 0.0, "logps/chosen": -5.0}] + [bad | {"loss": 5.0}] * 10
    got = fired(steps)
    assert sorted(code for code, _ in got) == sorted(WARNING_CODES)
    assert got == [
        ("nonfinite_skipped", 2),
        ("zero_advantage", 4),
        ("loss_diverging", 4),
        ("kl_diverging", 4),
        ("reward_collapse", 4),
        ("chosen_falling", 4),
    ]


def test_window_one_and_validation() -> None:
    assert fired([{"reward/std": 1.0}, {"reward/std": 0.0}], window=1) == [("reward_collapse", 2)]
    with pytest.raises(ValueError, match="window"):
        RunHealth(window=0)
    with pytest.raises(ValueError, match="kl_limit"):
        RunHealth(kl_limit=NAN)


def test_chosen_falling_fires_when_the_chosen_nll_has_quadrupled_for_three_steps() -> None:
    # first = -4: falling means below -4 - 3 * max(1, 4) = -16. 2: -16 is not below | 3, 4, 6: -17, -30,
    # -16.5 falling (5 has no logps/chosen: not counted) -> fires at 6.
    steps = [
        {"logps/chosen": -4.0},
        {"logps/chosen": -16.0},
        {"logps/chosen": -17.0},
        {"logps/chosen": -30.0},
        {"loss": 0.2},
        {"logps/chosen": -16.5},
    ]
    (w,) = feed(steps)
    assert (w.code, w.step) == ("chosen_falling", 6)
    assert "from -4 " in w.message and "logps/chosen=-30 at step 4" in w.message and "rpo_alpha" in w.message


def test_chosen_falling_near_misses() -> None:
    # A small first value needs a fall of at least 3 nats; one step back above the line resets.
    assert fired([{"logps/chosen": -0.2}] + [{"logps/chosen": -3.1}] * 5) == []
    assert fired([{"logps/chosen": -0.2}] + [{"logps/chosen": -3.3}] * 3) == [("chosen_falling", 4)]
    down, up = {"logps/chosen": -50.0}, {"logps/chosen": -12.0}
    assert fired([{"logps/chosen": -10.0}, down, down, up, down, down]) == []
    assert fired([{"logps/chosen": -530.0}] + [{"logps/chosen": -2000.0}] * 5) == []  # HH sums: < 4x NLL


def test_the_api_schema_names_every_code_in_order() -> None:
    """The API's warning schema (rlrun/schemas.py) is written apart from the rules; they must agree."""
    assert SCHEMA_CODES == WARNING_CODES
