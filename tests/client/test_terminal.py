"""The CLI's pure renderers against strings derived by hand (levels, cells and padding counted out)."""

from __future__ import annotations

import math

import pytest

from rlrun.terminal import (
    WatchState,
    bar,
    format_value,
    human_bytes,
    key_metrics,
    percent,
    progress_line,
    redraw,
    resample,
    sparkline,
    status_line,
    watch_frame,
)


def test_sparkline_maps_min_to_lowest_and_max_to_highest_block() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7], 8) == "▁▂▃▄▅▆▇█"
    assert sparkline([7, 6, 5, 4, 3, 2, 1, 0], 8) == "█▇▆▅▄▃▂▁"


def test_sparkline_rounds_levels_half_up() -> None:
    # (v - min) / (max - min) * 7: 0, 3.5 -> 4, 7
    assert sparkline([0, 1, 2], 10) == "▁▅█"
    # range 7: levels 0, 2, 7
    assert sparkline([-3, -1, 4], 10) == "▁▃█"


def test_sparkline_averages_buckets_when_longer_than_width() -> None:
    # buckets [0, 2] [4, 6] [1, 1] [10, 10] -> means 1, 5, 1, 10; levels 0, 4/9*7 = 3.1 -> 3, 0, 7
    assert sparkline([0, 2, 4, 6, 1, 1, 10, 10], 4) == "▁▄▁█"
    # n=5, width=2: buckets [0:2] and [2:5] -> means 2 and 7
    assert sparkline([1, 3, 5, 7, 9], 2) == "▁█"


def test_sparkline_degenerate_inputs() -> None:
    assert sparkline([], 5) == ""
    assert sparkline([1.0, 2.0], 0) == ""
    assert sparkline([2, 2, 2], 10) == "▄▄▄"
    assert sparkline([5.0] * 20, 4) == "▄▄▄▄"
    assert sparkline([math.nan, 0, math.inf, 7], 8) == "▁█"  # non-finite values are left out
    assert sparkline([math.nan], 8) == ""


def test_resample_keeps_short_series_and_averages_long_ones() -> None:
    assert resample([1, 2, 3], 5) == [1, 2, 3]
    assert resample(list(range(10)), 5) == [0.5, 2.5, 4.5, 6.5, 8.5]


@pytest.mark.parametrize(
    ("done", "total", "width", "expected"),
    [
        (5, 10, 10, "█████░░░░░"),
        (9.99, 10, 10, "█████████░"),  # full only when done
        (10, 10, 4, "████"),
        (15, 10, 4, "████"),
        (-1, 10, 4, "░░░░"),
        (0, 0, 3, "███"),  # nothing to do is done
    ],
)
def test_bar(done: float, total: float, width: int, expected: str) -> None:
    assert bar(done, total, width) == expected


def test_percent_and_human_bytes() -> None:
    assert [percent(1, 3), percent(2, 3), percent(3, 3), percent(0, 0)] == [33, 66, 100, 100]
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1024) == "1.0 KiB"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(5 * 1024**2) == "5.0 MiB"
    assert human_bytes(3 * 1024**5) == "3072.0 TiB"


def test_progress_line() -> None:
    assert progress_line("pairs.jsonl", 512, 2048, width=8) == "pairs.jsonl  ██░░░░░░   25%  512 B / 2.0 KiB"
    assert progress_line("x", 2048, 2048, width=4) == "x  ████  100%  2.0 KiB / 2.0 KiB"


def test_format_value() -> None:
    assert [format_value(v) for v in (0.344372, 1.0, -12.5, 12345.6, math.nan)] == [
        "0.3444",
        "1",
        "-12.5",
        "1.235e+04",
        "nan",
    ]


def test_key_metrics_prefers_rewards_then_losses_and_skips_bookkeeping() -> None:
    dpo_keys = [
        "final/loss",
        "final/rewards/accuracy",
        "grad_norm",
        "logps/chosen",
        "logps/rejected",
        "loss",
        "lr",
        "perf/tokens_per_s",
        "rewards/accuracy",
        "rewards/chosen",
        "rewards/margin",
        "rewards/rejected",
    ]
    assert key_metrics(dpo_keys) == [
        "rewards/accuracy",
        "rewards/margin",
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "grad_norm",
    ]
    others = ["zeta", "kl/custom", "value/loss", "perf/x", "lr", "final/loss"]
    assert key_metrics(others) == ["value/loss", "kl/custom", "zeta"]
    assert key_metrics(others, limit=2) == ["value/loss", "kl/custom"]
    assert key_metrics([]) == []


RUNNING = WatchState(
    run_id="r1",
    status="running",
    step=5,
    total_steps=10,
    algorithm="dpo",
    model="tiny",
    series={"loss": [3.0, 2.0, 1.0], "rewards/accuracy": [0.5, 0.5]},
)


def test_watch_frame_running() -> None:
    # names padded to 16 ("rewards/accuracy"), values right-aligned in 10, then the sparkline:
    # loss 3, 2, 1 -> levels 7, 3.5 -> 4, 0
    assert watch_frame(RUNNING, bar_width=10, spark_width=8) == (
        "run r1  dpo  tiny\n"
        "status  running\n"
        "step    5/10  █████░░░░░   50%\n"
        "loss                       1  █▅▁\n"
        "rewards/accuracy         0.5  ▄▄"
    )


def test_watch_frame_failed_without_total_or_metrics_and_cut_to_width() -> None:
    failed = WatchState(
        run_id="r2", status="failed", step=3, total_steps=None, name="try", error="ValueError: boom"
    )
    assert watch_frame(failed) == (
        "run r2  (try)\nstatus  failed\nstep    3\n(no metrics yet)\nerror   ValueError: boom"
    )
    assert watch_frame(failed, width=6) == "run r2\nstatus\nstep  \n(no me\nerror "


def test_status_line_and_redraw() -> None:
    assert status_line(RUNNING) == "running  step 5/10  loss=1  rewards/accuracy=0.5"
    assert status_line(WatchState(run_id="r", status="queued", step=0, total_steps=None)) == "queued  step 0"
    assert redraw("a\nb", 0) == "\r\x1b[Ja\nb\n"
    assert redraw("a\nb", 2) == "\r\x1b[2A\x1b[Ja\nb\n"
