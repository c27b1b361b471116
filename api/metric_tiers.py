"""Chart tiers of a metric series: per bucket of steps, its lowest and highest point (pure, no DB).

A key's series is cut, at each width ``w`` of ``TIER_WIDTHS``, into buckets ``b = step // w`` (steps
``[b*w, (b+1)*w)``); a bucket keeps its lowest and highest point as (value, step) pairs. A chart of a
long run reads these instead of every point: at 1M points the 1,000-point chart query reads some 800 to
6,400 bucket rows (api/metric_store.py), and min-max downsampling of the buckets' extremes keeps every spike
and dip that min-max downsampling of the raw points keeps (api/downsample.py).

Ties are broken by step so that merging is associative: the lowest point is the smallest
``(value, step)``, the highest the largest ``(value, -step)`` (the earliest of equal highs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

TIER_WIDTHS = (16, 128, 1024, 8192)  # each 8x the last: a chart reads at most ~8 buckets per point pair


class Extremes(NamedTuple):
    """A bucket's lowest point (min_step, min_value) and highest point (max_step, max_value)."""

    min_step: int
    min_value: float
    max_step: int
    max_value: float

    def merge(self, other: Extremes) -> Extremes:
        low = min((self.min_value, self.min_step), (other.min_value, other.min_step))
        high = max((self.max_value, -self.max_step), (other.max_value, -other.max_step))
        return Extremes(low[1], low[0], -high[1], high[0])

    @classmethod
    def of_point(cls, step: int, value: float) -> Extremes:
        return cls(step, value, step, value)


def bucket_extremes(points: Iterable[tuple[int, float]], width: int) -> dict[int, Extremes]:
    """{bucket: Extremes} of ``(step, value)`` points at ``width`` (buckets with no point left out)."""
    acc: dict[int, list[float]] = {}  # bucket -> [min_step, min_value, max_step, max_value]
    for step, value in points:
        b = step // width
        cur = acc.get(b)
        if cur is None:
            acc[b] = [step, value, step, value]
            continue
        if value < cur[1] or (value == cur[1] and step < cur[0]):
            cur[0], cur[1] = step, value
        if value > cur[3] or (value == cur[3] and step < cur[2]):
            cur[2], cur[3] = step, value
    return {b: Extremes(int(c[0]), c[1], int(c[2]), c[3]) for b, c in acc.items()}


def coarser(buckets: Mapping[int, Extremes], ratio: int) -> dict[int, Extremes]:
    """The buckets ``ratio`` times wider, from these narrower ones (bucket ``b`` -> ``b // ratio``)."""
    out: dict[int, Extremes] = {}
    for b, e in buckets.items():
        parent = b // ratio
        out[parent] = out[parent].merge(e) if parent in out else e
    return out


def merge_extremes(parts: Iterable[Extremes]) -> Extremes | None:
    """The extremes of the union of buckets (None for none)."""
    out: Extremes | None = None
    for e in parts:
        out = e if out is None else out.merge(e)
    return out


def chart_width(first: int, last: int, pairs: int) -> int | None:
    """The widest tier with at least ``pairs`` buckets between steps ``first`` and ``last``; None when
    even the narrowest has fewer (read the raw points: there are at most ~``16 * pairs`` of them)."""
    span = last - first + 1
    fitting = [w for w in TIER_WIDTHS if span // w >= pairs]
    return max(fitting) if fitting else None


def full_buckets(first: int, last: int, width: int) -> range:
    """The buckets at ``width`` that lie wholly inside steps ``[first, last]``."""
    return range(-(-first // width), (last + 1) // width)
