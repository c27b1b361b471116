"""Alembic environment: URL from settings (or the caller's config), metadata from api.models."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from api import models  # noqa: F401  (registers the tables on Base.metadata)
from api.db import Base, make_engine
from api.settings import get_settings

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or get_settings().resolved_database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:  # a caller (tests) handed us an open connection
        _run(connection)
        return
    engine = make_engine(_url())
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


def _sqlite_pragma(connection: Connection, pragma: str) -> None:
    """On the driver's connection: through SQLAlchemy it would first open a transaction (api/db.py
    begins every one IMMEDIATE), inside which SQLite ignores a foreign_keys PRAGMA."""
    driver = connection.connection.driver_connection
    assert driver is not None
    driver.execute(f"PRAGMA {pragma}")


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite can't ALTER most things: batch mode copies the table
        compare_type=True,
    )
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # Batch mode copies a table and drops the old one; with foreign keys on, SQLite's DROP TABLE
        # cascades (a run's metrics, events and checkpoints deleted) or fails ("FOREIGN KEY constraint
        # failed" on datasets). Off for the migration (a PRAGMA outside any transaction), then checked.
        _sqlite_pragma(connection, "foreign_keys=OFF")
    try:
        with context.begin_transaction():
            context.run_migrations()
            if sqlite:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise RuntimeError(f"rows whose foreign keys point nowhere after migrating: {broken[:3]}")
    finally:
        if sqlite:
            _sqlite_pragma(connection, "foreign_keys=ON")


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
