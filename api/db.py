"""SQLAlchemy base, engine and session factory.

Nothing is built at import: callers make the engine from a URL (``make_engine``) and own its lifetime.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime, Dialect, Engine, MetaData, TypeDecorator, create_engine, event
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # SQLite has one writer at a time: WAL lets readers (the API) go on while the worker writes, and the
    # busy timeout makes a writer wait for the lock instead of failing at once (DESIGN "Defaults").
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_begin(conn: Any) -> None:
    # IMMEDIATE takes the write lock up front. A deferred BEGIN that reads and then writes fails at once
    # with "database is locked" (SQLITE_BUSY_SNAPSHOT, which the busy timeout does not retry) whenever
    # another process committed in between: exactly the API-while-the-worker-writes case.
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url``; SQLite connections get WAL, a busy timeout and foreign keys.

    pysqlite's own transaction handling breaks SAVEPOINT (SQLAlchemy "pysqlite" docs): we turn it off
    and emit BEGIN IMMEDIATE ourselves, so nested transactions behave as on PostgreSQL and concurrent
    writers queue on the busy timeout instead of failing.
    """
    if url.startswith("sqlite"):
        connect_args = {"check_same_thread": False, "timeout": 30}
        engine = create_engine(url, connect_args=connect_args, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    return create_engine(url, pool_pre_ping=True, **kwargs)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (routes read the row they just wrote)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def commit_unless_conflict(session: Session) -> bool:
    """Commit ``session``; if a constraint refuses the commit (a unique key a concurrent request took
    first, a row another one still refers to), roll back and answer False."""
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        return False
    return True


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite stores naive text; we read it back as UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime; use an aware UTC datetime")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
