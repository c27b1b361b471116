"""Chart tiers (api/metric_tiers.py) and the metric store (api/metric_store.py) against brute force.

Tiers are checked against min/max taken over the stored points by plain Python after writes in several
flushes, overwrites (a retried attempt) included; chart series against the raw series: only stored points,
first and last kept, the extremes kept, at most ``max_points``, and equal to min-max downsampling of a
candidate set built here from the raw points by hand.
"""

from __future__ import annotations

import random
import uuid
from bisect import bisect_left
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.downsample import minmax_downsample
from api.metric_store import chart_points, write_points
from api.metric_tiers import TIER_WIDTHS, Extremes, bucket_extremes, chart_width, coarser, full_buckets
from api.models import Metric, MetricTier, utcnow
from tests.factories import api_client, make_dataset, make_run


def brute_extremes(points: dict[int, float], width: int) -> dict[int, tuple[int, float, int, float]]:
    """Per bucket: the lowest (value, then earliest step) and highest (value, then earliest step) point."""
    buckets: dict[int, list[tuple[int, float]]] = {}
    for step, value in points.items():
        buckets.setdefault(step // width, []).append((step, value))
    out = {}
    for b, pts in buckets.items():
        lo = min(pts, key=lambda p: (p[1], p[0]))
        hi = min(pts, key=lambda p: (-p[1], p[0]))
        out[b] = (lo[0], lo[1], hi[0], hi[1])
    return out


def test_bucket_extremes_and_coarser_match_brute_force_with_ties() -> None:
    rng = random.Random(1)
    points = {s: float(rng.randint(0, 5)) for s in rng.sample(range(5000), 1500)}  # many ties
    for width in TIER_WIDTHS:
        got = {b: tuple(e) for b, e in bucket_extremes(points.items(), width).items()}
        assert got == brute_extremes(points, width)
    narrow = bucket_extremes(points.items(), 16)
    assert coarser(narrow, 8) == bucket_extremes(points.items(), 128)
    a, b = Extremes(3, 1.0, 3, 1.0), Extremes(1, 1.0, 1, 1.0)
    assert a.merge(b) == b.merge(a) == Extremes(1, 1.0, 1, 1.0)  # ties go to the earlier step


def test_chart_width_and_full_buckets() -> None:
    assert chart_width(0, 999, 499) is None  # 1,000 steps: fewer than 499 buckets of 16
    assert chart_width(0, 49_999, 499) == 16  # 3,125 buckets of 16; 128 would give 390
    assert chart_width(0, 999_999, 499) == 1024  # 976 buckets; 8192 would give 122
    assert list(full_buckets(5, 70, 16)) == [1, 2, 3]  # steps 16..63; 5..15 and 64..70 are edges
    assert list(full_buckets(16, 63, 16)) == [1, 2, 3]


def rows_of(run_id: uuid.UUID, points: dict[str, dict[int, float]]) -> list[dict[str, Any]]:
    now = utcnow()
    return [
        {"run_id": run_id, "key": k, "step": s, "value": v, "logged_at": now + timedelta(microseconds=s)}
        for k, steps in points.items()
        for s, v in steps.items()
    ]


def stored_tiers(session: Session, run_id: uuid.UUID, key: str, width: int) -> dict[int, tuple[Any, ...]]:
    t = MetricTier
    stmt = select(t.bucket, t.min_step, t.min_value, t.max_step, t.max_value)
    stmt = stmt.where(t.run_id == run_id, t.key == key, t.width == width)
    return {b: tuple(rest) for b, *rest in session.execute(stmt)}


def stored_points(session: Session, run_id: uuid.UUID, key: str) -> dict[int, float]:
    stmt = select(Metric.step, Metric.value).where(Metric.run_id == run_id, Metric.key == key)
    return dict(session.execute(stmt).all())


def test_tiers_equal_brute_force_after_flushes_and_overwrites(session: Session) -> None:
    run = make_run(session, make_dataset(session))
    rng = random.Random(2)
    truth: dict[str, dict[int, float]] = {"loss": {}, "eval/acc": {}}
    # a training run: loss every step, eval every 50 steps, flushed every 700 steps
    for start in range(0, 12_000, 700):
        batch: dict[str, dict[int, float]] = {"loss": {}, "eval/acc": {}}
        for s in range(start, start + 700):
            batch["loss"][s] = rng.gauss(0, 1)
            if s % 50 == 0:
                batch["eval/acc"][s] = rng.random()
        write_points(session, rows_of(run.id, batch))
        for k in truth:
            truth[k].update(batch[k])
    # a retried attempt rewrites steps 5,000..6,399: the old extremes there must go
    lowest = min(range(5000, 6400), key=lambda s: truth["loss"][s])
    retry = {"loss": {s: rng.gauss(0, 0.1) for s in range(5000, 6400)}, "eval/acc": {}}
    retry["loss"][lowest] = 0.0  # the bucket's old minimum overwritten by a higher value
    write_points(session, rows_of(run.id, retry))
    truth["loss"].update(retry["loss"])
    for key in truth:
        assert stored_points(session, run.id, key) == truth[key]
        for width in TIER_WIDTHS:
            expected = brute_extremes(truth[key], width)
            assert stored_tiers(session, run.id, key, width) == expected, (key, width)


def expected_chart(points: dict[int, float], lo: int, hi: int, max_points: int) -> list[tuple[int, float]]:
    """Built by hand from the raw points: first, last, raw points of the edge buckets, the extremes of
    each whole bucket at the chosen width; then min-max downsampled."""
    inside = sorted((s, v) for s, v in points.items() if lo <= s <= hi)
    if not inside:
        return []
    first, last = inside[0][0], inside[-1][0]
    width = chart_width(first, last, (max_points - 2) // 2)
    if width is None:
        return minmax_downsample(inside, [v for _, v in inside], max_points)
    a, b = -(-first // width) * width, (last + 1) // width * width  # whole buckets: steps a..b-1
    cand = {s: v for s, v in inside if s < a or s >= b or s in (first, last)}
    steps = [s for s, _ in inside]
    for start in range(a, b, width):
        # inside is sorted by step: the bucket is the slice between its bounds
        bucket = inside[bisect_left(steps, start) : bisect_left(steps, start + width)]
        if bucket:
            low = min(bucket, key=lambda p: (p[1], p[0]))
            high = min(bucket, key=lambda p: (-p[1], p[0]))
            cand[low[0]], cand[high[0]] = low[1], high[1]
    pts = sorted(cand.items())
    return minmax_downsample(pts, [v for _, v in pts], max_points)


def test_chart_points_keep_the_extremes_and_only_stored_points(session: Session) -> None:
    run = make_run(session, make_dataset(session))
    rng = random.Random(3)
    walk, level = {}, 0.0
    for s in range(1, 40_001):
        level += rng.gauss(0, 1)
        walk[s] = level
    walk[23_456] = 1e6  # a spike
    sparse = {s: rng.random() for s in range(0, 40_000, 997)}
    write_points(session, rows_of(run.id, {"walk": walk, "sparse": sparse}))
    ranges = [(None, None), (100, 30_000), (23_000, 24_000), (7, 9), (39_990, 50_000), (50_000, None)]
    for key, points in (("walk", walk), ("sparse", sparse)):
        for lo, hi in ranges:
            for max_points in (4, 100, 1000):
                got = chart_points(session, run.id, key, lo, hi, max_points)
                a, b = lo if lo is not None else 0, hi if hi is not None else 10**9
                inside = {s: v for s, v in points.items() if a <= s <= b}
                assert got == expected_chart(points, a, b, max_points), (key, lo, hi, max_points)
                assert len(got) <= max_points and all(inside[s] == v for s, v in got)
                if inside:
                    assert got[0][0] == min(inside) and got[-1][0] == max(inside)
                    if max_points >= 100:
                        assert max(v for _, v in got) == max(inside.values())
                        assert min(v for _, v in got) == min(inside.values())
    assert (23_456, 1e6) in chart_points(session, run.id, "walk", None, None, 100)


def test_metrics_as_columns_with_times(session: Session) -> None:
    run = make_run(session, make_dataset(session))
    now = utcnow()
    rows = [
        {"run_id": run.id, "key": "loss", "step": s, "value": 1 / s, "logged_at": now + timedelta(seconds=s)}
        for s in range(1, 301)
    ] + [{"run_id": run.id, "key": "lr", "step": 1, "value": 0.5, "logged_at": now}]
    write_points(session, rows)
    with api_client(session) as client:
        cols = client.get(f"/v1/runs/{run.id}/metrics", params={"format": "columns", "max_points": 50})
        timed = client.get(
            f"/v1/runs/{run.id}/metrics",
            params={"format": "columns", "max_points": 1000, "key": "loss", "time": "true", "min_step": 290},
        )
        listed = client.get(f"/v1/runs/{run.id}/metrics", params={"max_points": 50, "key": "loss"}).json()
        no_points = client.get(f"/v1/runs/{run.id}/metrics", params={"format": "columns"})
        gz = client.get(
            f"/v1/runs/{run.id}/metrics",
            params={"max_points": 1000},
            headers={"Accept-Encoding": "gzip"},
        )
    assert cols.status_code == 200 and set(cols.json()) == {"loss", "lr"}
    loss = cols.json()["loss"]
    assert loss["step"] == [m["step"] for m in listed["data"]]
    assert loss["value"] == [m["value"] for m in listed["data"]] and "time" not in loss
    assert cols.json()["lr"] == {"step": [1], "value": [0.5]}
    t = timed.json()["loss"]
    assert t["step"] == list(range(290, 301)) and t["value"] == [1 / s for s in range(290, 301)]
    assert t["time"] == pytest.approx([(now + timedelta(seconds=s)).timestamp() for s in range(290, 301)])
    assert no_points.status_code == 422 and no_points.json()["error"]["field"] == "max_points"
    assert gz.headers.get("content-encoding") == "gzip"  # JSON of any size is compressed
