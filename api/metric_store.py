"""A run's metric points in the database: writing them with their chart tiers, reading chart series.

Writing (``write_points``, the worker's flush): the points are upserted (a (run, key, step) written before,
by a retried attempt, is overwritten), then each tier bucket they touch (api/metric_tiers.py) is merged
with the bucket's stored extremes. Where a point overwrote a bucket's stored extreme with another value,
that bucket is computed again from the level below (the raw points, or the next narrower tier), so the
tiers always equal what ``bucket_extremes`` gives over the stored points.

Rows go to the driver as tuples, each distinct run id and time converted once: SQLAlchemy's per-row
parameter processing cost more than the database's own work. On PostgreSQL new points are ``COPY``-ed
straight into the table inside a savepoint; when one is stored already (a retried attempt) that is rolled
back and the batch is ``COPY``-ed into a temporary table and upserted from it. SQLite takes an
``INSERT ... ON CONFLICT`` by ``executemany``. Measured (bench/metrics.py, 1M points, tiers included):
SQLite 49.0k -> 69.5k points/s, PostgreSQL 25.4k -> 47.7k (docs/benchmarks.md).

Reading (``chart_points``): a key's series between two steps cut to ``max_points``. A short range reads its
raw points; a long one reads the first and last points, the raw points of the two partial buckets at its
edges and the extremes of the whole buckets between them at the widest tier that still gives
``max_points / 2`` buckets, then min-max downsamples those (api/downsample.py).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from operator import itemgetter
from typing import Any

import psycopg
from sqlalchemy import Connection, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.downsample import minmax_downsample
from api.metric_tiers import (
    TIER_WIDTHS,
    Extremes,
    bucket_extremes,
    chart_width,
    coarser,
    full_buckets,
    merge_extremes,
)
from api.models import Metric, MetricTier

Point = tuple[int, float]
IN_CHUNK = 900  # parameters per IN list (SQLite allows 999 in old builds)


# ---------- writing ----------

POINT_COLUMNS = ("run_id", "key", "step", "value", "logged_at")
TIER_COLUMNS = ("run_id", "key", "width", "bucket", "min_step", "min_value", "max_step", "max_value")
# table: (columns, conflict target, updated columns, PostgreSQL types of the columns)
UPSERTS = {
    "metrics": (
        POINT_COLUMNS,
        ("run_id", "key", "step"),
        ("value", "logged_at"),
        "run_id uuid, key varchar(200), step integer, value double precision, logged_at timestamptz",
    ),
    "metric_tiers": (
        TIER_COLUMNS,
        ("run_id", "key", "width", "bucket"),
        ("min_step", "min_value", "max_step", "max_value"),
        "run_id uuid, key varchar(200), width integer, bucket integer, min_step integer, "
        "min_value double precision, max_step integer, max_value double precision",
    ),
}


def _upsert_rows(session: Session, table: str, rows: Sequence[tuple[Any, ...]]) -> None:
    """Insert ``rows`` (tuples in the table's UPSERTS column order, values as Python objects); a row
    whose key is stored already replaces it. Driver-level: SQLAlchemy's per-row parameter processing
    cost more than the database's own work (bench/metrics.py)."""
    if not rows:
        return
    columns, conflict, updated, pg_types = UPSERTS[table]
    names = ", ".join(columns)
    on_conflict = f"ON CONFLICT ({', '.join(conflict)}) DO UPDATE SET " + ", ".join(
        f"{c} = excluded.{c}" for c in updated
    )
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        # New points (the usual case: a run logs steps it has not logged before) are COPied straight in;
        # if any is stored already (a retried attempt), that COPY is rolled back to its savepoint and the
        # rows go through the upsert below. Not tiers: nearly every flush updates the bucket the last one
        # ended in, so a straight COPY of them would fail and be sent twice.
        if table == "metrics":
            try:
                with conn.begin_nested():
                    _copy(conn, table, names, rows)
                return
            except IntegrityError:
                pass
        # COPY into a temporary table (one per connection, emptied at commit), then one upsert from it
        # (rows are unique by their conflict target: one INSERT ... ON CONFLICT may not touch a row twice).
        incoming = f"{table}_incoming"
        conn.exec_driver_sql(
            f"CREATE TEMPORARY TABLE IF NOT EXISTS {incoming} ({pg_types}) ON COMMIT DELETE ROWS"
        )
        _copy(conn, incoming, names, rows)
        conn.exec_driver_sql(f"INSERT INTO {table} ({names}) SELECT {names} FROM {incoming} {on_conflict}")
        conn.exec_driver_sql(f"TRUNCATE {incoming}")
        return
    # SQLite: convert each distinct run id and time once, as SQLAlchemy's column types would.
    dialect = conn.dialect
    model = Metric if table == "metrics" else MetricTier
    to_db = {
        i: _bind_processor(getattr(model, c).type, dialect)
        for i, c in enumerate(columns)
        if c in ("run_id", "logged_at")
    }
    cache: dict[tuple[int, Any], Any] = {}

    def convert(i: int, v: Any) -> Any:
        if (i, v) not in cache:
            cache[i, v] = to_db[i](v)
        return cache[i, v]

    converted = [tuple(convert(i, v) if i in to_db else v for i, v in enumerate(row)) for row in rows]
    marks = ", ".join("?" for _ in columns)
    conn.exec_driver_sql(f"INSERT INTO {table} ({names}) VALUES ({marks}) {on_conflict}", converted)


def _copy(conn: Connection, table: str, names: str, rows: Sequence[tuple[Any, ...]]) -> None:
    driver = conn.connection.driver_connection
    assert driver is not None
    try:
        with driver.cursor() as cursor, cursor.copy(f"COPY {table} ({names}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
    except psycopg.errors.UniqueViolation as exc:
        raise IntegrityError(f"COPY {table}", None, exc) from exc


def _bind_processor(type_: Any, dialect: Any) -> Any:
    proc = type_.dialect_impl(dialect).bind_processor(dialect)
    return proc if proc is not None else (lambda v: v)


def write_points(session: Session, rows: Sequence[Mapping[str, Any]]) -> None:
    """Upsert metric rows (``run_id``, ``key``, ``step``, ``value``, ``logged_at``; values finite) and
    bring the chart tiers of the buckets they touch up to date, in the caller's transaction."""
    if not rows:
        return
    unique = {(r["run_id"], r["key"], r["step"]): r for r in rows}  # the last of a repeated point wins
    as_tuple = itemgetter(*POINT_COLUMNS)
    _upsert_rows(session, "metrics", [as_tuple(r) for r in unique.values()])
    by_run: dict[uuid.UUID, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        by_run[r["run_id"]][r["key"]][r["step"]] = r["value"]
    for run_id, points in by_run.items():
        update_tiers(session, run_id, points)


def update_tiers(session: Session, run_id: uuid.UUID, points: Mapping[str, Mapping[int, float]]) -> None:
    """Merge ``{key: {step: value}}`` (points just written) into the run's tiers, narrowest first."""
    fresh = {key: bucket_extremes(steps.items(), TIER_WIDTHS[0]) for key, steps in points.items() if steps}
    for level, width in enumerate(TIER_WIDTHS):
        if level:
            ratio = width // TIER_WIDTHS[level - 1]
            fresh = {key: coarser(buckets, ratio) for key, buckets in fresh.items()}
        stored = _read_tiers(session, run_id, width, {k: (min(b), max(b)) for k, b in fresh.items()})
        out: dict[tuple[str, int], Extremes] = {}
        stale: dict[str, set[int]] = defaultdict(set)
        for key, buckets in fresh.items():
            for b, new in buckets.items():
                old = stored.get((key, b))
                if old is None:
                    out[key, b] = new
                elif _overwrote_an_extreme(old, points[key]):
                    stale[key].add(b)
                else:
                    out[key, b] = old.merge(new)
        if stale:
            out |= _recompute(session, run_id, level, stale)
        _upsert_rows(session, "metric_tiers", [(run_id, k, width, b, *e) for (k, b), e in out.items()])


def _overwrote_an_extreme(old: Extremes, steps: Mapping[int, float]) -> bool:
    return steps.get(old.min_step, old.min_value) != old.min_value or (
        steps.get(old.max_step, old.max_value) != old.max_value
    )


def _recompute(
    session: Session, run_id: uuid.UUID, level: int, stale: Mapping[str, set[int]]
) -> dict[tuple[str, int], Extremes]:
    """Buckets at ``TIER_WIDTHS[level]`` from the level below (already up to date in this transaction)."""
    width = TIER_WIDTHS[level]
    out: dict[tuple[str, int], Extremes] = {}
    for key, buckets in stale.items():
        lo, hi = min(buckets), max(buckets)
        if level == 0:
            rows = session.execute(
                select(Metric.step, Metric.value).where(
                    Metric.run_id == run_id,
                    Metric.key == key,
                    Metric.step.between(lo * width, (hi + 1) * width - 1),
                )
            ).all()
            parts: Iterable[tuple[int, Extremes]] = ((s, Extremes.of_point(s, v)) for s, v in rows)
        else:
            below = TIER_WIDTHS[level - 1]
            ratio = width // below
            found = _read_tiers(session, run_id, below, {key: (lo * ratio, (hi + 1) * ratio - 1)})
            parts = ((b * below, e) for (_, b), e in found.items())
        grouped: dict[int, list[Extremes]] = defaultdict(list)
        for start_step, e in parts:
            if start_step // width in buckets:
                grouped[start_step // width].append(e)
        for b in buckets:
            merged = merge_extremes(grouped.get(b, ()))
            if merged is not None:
                out[key, b] = merged
    return out


def _read_tiers(
    session: Session, run_id: uuid.UUID, width: int, ranges: Mapping[str, tuple[int, int]]
) -> dict[tuple[str, int], Extremes]:
    """Stored buckets at ``width`` of each key between two bucket numbers (inclusive)."""
    out: dict[tuple[str, int], Extremes] = {}
    if not ranges:
        return out
    lo = min(r[0] for r in ranges.values())
    hi = max(r[1] for r in ranges.values())
    keys = sorted(ranges)
    for i in range(0, len(keys), IN_CHUNK):
        stmt = select(
            MetricTier.key,
            MetricTier.bucket,
            MetricTier.min_step,
            MetricTier.min_value,
            MetricTier.max_step,
            MetricTier.max_value,
        ).where(
            MetricTier.run_id == run_id,
            MetricTier.key.in_(keys[i : i + IN_CHUNK]),
            MetricTier.width == width,
            MetricTier.bucket.between(lo, hi),
        )
        for key, b, min_step, min_value, max_step, max_value in session.execute(stmt):
            if ranges[key][0] <= b <= ranges[key][1]:
                out[key, b] = Extremes(min_step, min_value, max_step, max_value)
    return out


# ---------- reading ----------


def chart_points(
    session: Session,
    run_id: uuid.UUID,
    key: str,
    min_step: int | None,
    max_step: int | None,
    max_points: int,
) -> list[Point]:
    """At most ``max_points`` (step, value) points of the key between the steps (inclusive), in step
    order: first and last kept, min-max downsampled; every point returned is a stored point."""
    raw = select(Metric.step, Metric.value).where(Metric.run_id == run_id, Metric.key == key)
    if min_step is not None:
        raw = raw.where(Metric.step >= min_step)
    if max_step is not None:
        raw = raw.where(Metric.step <= max_step)
    first = session.execute(raw.order_by(Metric.step).limit(1)).first()
    if first is None:
        return []
    last = session.execute(raw.order_by(Metric.step.desc()).limit(1)).one()
    width = chart_width(first.step, last.step, (max_points - 2) // 2) if max_points >= 4 else None
    if width is None:
        rows: list[Point] = [tuple(r) for r in session.execute(raw.order_by(Metric.step))]  # type: ignore[misc]
        return minmax_downsample(rows, [v for _, v in rows], max_points)
    whole = full_buckets(first.step, last.step, width)
    # The partial buckets at the edges, raw: two index ranges (an OR of both reads the whole range).
    found: dict[int, float] = {first.step: first.value, last.step: last.value}
    for edge in (Metric.step < whole.start * width, Metric.step >= whole.stop * width):
        found.update(dict(session.execute(raw.where(edge)).all()))
    for e in _read_tiers(session, run_id, width, {key: (whole.start, whole.stop - 1)}).values():
        found[e.min_step] = e.min_value
        found[e.max_step] = e.max_value
    points = sorted(found.items())
    return minmax_downsample(points, [v for _, v in points], max_points)


def point_times(session: Session, run_id: uuid.UUID, key: str, steps: Sequence[int]) -> dict[int, datetime]:
    """When each of these steps' points of the key was logged."""
    out: dict[int, datetime] = {}
    for i in range(0, len(steps), IN_CHUNK):
        stmt = select(Metric.step, Metric.logged_at).where(
            Metric.run_id == run_id, Metric.key == key, Metric.step.in_(steps[i : i + IN_CHUNK])
        )
        out.update(dict(session.execute(stmt).all()))
    return out
