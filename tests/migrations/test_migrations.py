"""Alembic: upgrade head -> downgrade base -> upgrade head, and the models match the migrations."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import MetaData, Table, create_engine, func, inspect, select

from api.metric_tiers import TIER_WIDTHS
from api.migrate import alembic_config
from tests.conftest import pg_test_database

TABLES = {
    "datasets",
    "dataset_rows",
    "dataset_skipped_lines",
    "dataset_sources",
    "runs",
    "metrics",
    "metric_tiers",
    "events",
    "checkpoints",
    "pipelines",
    "samples",
    "projects",
    "api_keys",
    "webhooks",
    "webhook_deliveries",
    "environments",
    "alembic_version",
}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'm.db'}"
    else:
        yield from pg_test_database()


def tables(url: str) -> set[str]:
    eng = create_engine(url)
    try:
        return set(inspect(eng).get_table_names())
    finally:
        eng.dispose()


def test_upgrade_downgrade_upgrade_and_check(empty_db: str) -> None:
    cfg = alembic_config(empty_db)
    command.upgrade(cfg, "head")
    assert tables(empty_db) == TABLES
    command.check(cfg)  # raises if the models and the migrations disagree
    command.downgrade(cfg, "base")
    assert tables(empty_db) == {"alembic_version"}
    command.upgrade(cfg, "head")
    assert tables(empty_db) == TABLES


def filled_row(table: Table, **given: Any) -> dict[str, Any]:
    """``given`` plus a plain value for every other NOT NULL column without a server default."""
    row = dict(given)
    for col in table.columns:
        try:
            python_type = col.type.python_type
        except NotImplementedError:  # JSON
            python_type = dict
        if isinstance(row.get(col.name), uuid.UUID) and python_type is str:  # SQLite keeps uuids as hex
            row[col.name] = row[col.name].hex
        if col.name in row or col.nullable or col.server_default is not None:
            continue
        row[col.name] = {
            uuid.UUID: uuid.uuid4(),
            str: "queued" if col.name == "status" else "preference" if col.name == "kind" else "x",
            int: 0,
            float: 0.0,
            bool: False,
            datetime: datetime.now(UTC),
            dict: {},
            list: [],
        }.get(python_type, {})
    return row


FIRST_REVISION = "41b5aa0c07d5"  # creates datasets, runs, metrics and events
TABLES_WITH_ROWS = ("datasets", "runs", "metrics", "events")


def test_data_of_the_first_revision_survives_every_migration(empty_db: str) -> None:
    """A run with metrics and an event stored at the first revision is all there at head: batch mode's
    table copies on SQLite once cascaded the run's metrics away, or failed on datasets' foreign keys.
    Its points get their tiers from the metric_tiers migration (brute force here), its name from its spec."""
    cfg = alembic_config(empty_db)
    command.upgrade(cfg, FIRST_REVISION)
    eng = create_engine(empty_db)
    rng = random.Random(0)
    points = {
        "loss": {s: rng.gauss(0, 1) for s in range(3000)},
        "eval": {s: rng.random() for s in range(0, 3000, 97)},
    }
    try:
        meta = MetaData()
        meta.reflect(eng)
        datasets, runs, metrics, events = (meta.tables[t] for t in ("datasets", "runs", "metrics", "events"))
        ds_id, run_id = uuid.uuid4(), uuid.uuid4()
        dialect = eng.dialect.name
        with eng.begin() as conn:
            conn.execute(datasets.insert().values(filled_row(datasets, id=ds_id)))
            conn.execute(
                runs.insert().values(
                    filled_row(
                        runs,
                        id=run_id,
                        dataset_id=ds_id,
                        spec={"name": "old run"},
                    )
                )
            )
            conn.execute(
                events.insert().values(filled_row(events, run_id=run_id, kind="status", message="queued"))
            )
            now = datetime.now(UTC)
            conn.execute(
                metrics.insert(),
                [
                    {
                        "run_id": run_id if dialect == "postgresql" else run_id.hex,
                        "key": k,
                        "step": s,
                        "value": v,
                        "logged_at": now,
                    }
                    for k, series in points.items()
                    for s, v in series.items()
                ],
            )
        command.upgrade(cfg, "head")
        meta = MetaData()
        meta.reflect(eng)
        tiers = meta.tables["metric_tiers"]
        with eng.connect() as conn:
            stored = conn.execute(select(tiers)).mappings().all()
            name = conn.execute(select(meta.tables["runs"].c.name)).scalar_one()
            kept = [
                conn.execute(select(func.count()).select_from(meta.tables[t])).scalar_one()
                for t in TABLES_WITH_ROWS
            ]
    finally:
        eng.dispose()
    assert kept == [1, 1, sum(len(series) for series in points.values()), 1]
    assert name == "old run"
    assert {(r["key"], r["width"]) for r in stored} == {(k, w) for k in points for w in TIER_WIDTHS}
    for key, series in points.items():
        for width in TIER_WIDTHS:
            got = {
                r["bucket"]: (r["min_step"], r["min_value"], r["max_step"], r["max_value"])
                for r in stored
                if r["key"] == key and r["width"] == width
            }
            expected = {}
            for b in {s // width for s in series}:
                inside = [(s, v) for s, v in series.items() if s // width == b]
                lo = min(inside, key=lambda p: (p[1], p[0]))
                hi = min(inside, key=lambda p: (-p[1], p[0]))
                expected[b] = (lo[0], lo[1], hi[0], hi[1])
            assert got == expected, (key, width)
