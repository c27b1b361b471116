"""Chart-sized metric series: min-max downsampling (pure, no DB).

A series of n points is cut into buckets of consecutive steps; each bucket keeps its lowest and highest
value (in step order), and the first and last points are always kept. Unlike plain striding, spikes and
dips survive, which is what a user scanning a reward or KL curve needs to see.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

P = TypeVar("P")


def minmax_downsample(points: Sequence[P], values: Sequence[float], max_points: int) -> list[P]:
    """At most ``max_points`` of ``points`` (ordered by step), keeping first, last and per-bucket extremes.

    ``values[i]`` is the value of ``points[i]``. With ``max_points`` >= n every point is returned.
    """
    n = len(points)
    if n <= max_points:
        return list(points)
    if max_points < 4:
        return [points[0], points[-1]][:max_points]
    inner = range(1, n - 1)
    n_buckets = (max_points - 2) // 2
    keep = {0, n - 1}
    for b in range(n_buckets):
        lo = inner.start + (len(inner) * b) // n_buckets
        hi = inner.start + (len(inner) * (b + 1)) // n_buckets
        if lo >= hi:
            continue
        bucket = range(lo, hi)
        keep.add(min(bucket, key=lambda i: values[i]))
        keep.add(max(bucket, key=lambda i: values[i]))
    return [points[i] for i in sorted(keep)]
