"""Shared fixtures: real databases (SQLite always; PostgreSQL when reachable), savepoint-isolated sessions.

PostgreSQL and Redis tests are skipped when the server is down, with one summary line saying so;
with CI=true a missing server fails the run instead.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session, sessionmaker

from api.db import make_engine, make_session_factory
from api.migrate import upgrade_head

PG_ADMIN_URL = os.environ.get(
    "RLRUN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("RLRUN_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
IN_CI = os.environ.get("CI", "").lower() == "true"


def _reachable(url: str, default_port: int) -> bool:
    parsed = urlparse(url.replace("+psycopg", ""))
    try:
        with socket.create_connection(
            (parsed.hostname or "127.0.0.1", parsed.port or default_port), timeout=1
        ):
            return True
    except OSError:
        return False


SERVICES = {"postgres": _reachable(PG_ADMIN_URL, 5432), "redis": _reachable(REDIS_URL, 6379)}
NEEDS = {"postgres": ("postgres",), "integration": ("postgres", "redis")}
_skipped: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        missing = sorted(
            {s for m, svcs in NEEDS.items() if item.get_closest_marker(m) for s in svcs if not SERVICES[s]}
        )
        if not missing:
            continue
        if IN_CI:
            raise pytest.UsageError(
                f"CI=true but {', '.join(missing)} is not reachable (needed by {item.nodeid})"
            )
        _skipped.append(item.nodeid)
        item.add_marker(pytest.mark.skip(reason=f"{', '.join(missing)} not reachable"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    down = [name for name, up in SERVICES.items() if not up]
    if down:
        terminalreporter.write_line(
            f"rlrun: {', '.join(down)} not reachable: skipped {len(_skipped)} test(s) that need it "
            "(set CI=true to fail instead)"
        )


def pg_test_database() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test session; dropped afterwards."""
    name = f"rlrun_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'rlrun.db'}"
    upgrade_head(url)
    return url


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    gen = pg_test_database()
    url = next(gen)
    upgrade_head(url)
    yield url
    next(gen, None)


@pytest.fixture(scope="session", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """The URL of a migrated database, once per backend."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture(scope="session")
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    """A session inside an outer transaction that is rolled back: commits in the code under test only
    release savepoints (SQLAlchemy "Joining a Session into an External Transaction")."""
    conn = engine.connect()
    outer = conn.begin()
    sess = Session(bind=conn, join_transaction_mode="create_savepoint", expire_on_commit=False)
    try:
        yield sess
    finally:
        sess.close()
        outer.rollback()
        conn.close()


@pytest.fixture
def committing_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that really commit (worker tests need separate transactions); tests use fresh ids."""
    return make_session_factory(engine)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Cache folder where tiny presets are built once per test session."""
    return tmp_path_factory.mktemp("cache")
