"""Alembic: upgrade head -> downgrade base -> upgrade head, and the models match the migrations."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect

from api.migrate import alembic_config
from tests.conftest import pg_test_database

TABLES = {
    "datasets",
    "dataset_rows",
    "dataset_skipped_lines",
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
