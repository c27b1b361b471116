"""Shared fixtures: real databases (SQLite always; PostgreSQL when reachable), savepoint-isolated sessions.

PostgreSQL and Redis tests are skipped when the server is down, with one summary line saying so;
with CI=true a missing server fails the run instead.

The suite runs in parallel (pytest-xdist, ``make test``): each worker process has its own PostgreSQL
databases (a fresh one per session, per drill), its own Redis database (``redis_url_for_worker``), its own
SQLite files and temporary folders, and free ports picked at bind time. Tiny model presets are built once
per run into a folder every worker shares (``tiny_model_dir`` writes atomically).
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections import Counter
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
# "gw0", "gw1", ... in a pytest-xdist worker; unset in a plain run.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
WORKER_INDEX = int(XDIST_WORKER.removeprefix("gw")) if XDIST_WORKER.startswith("gw") else 0
REDIS_DATABASES = 16  # Redis's default `databases`


def redis_url_for_worker(base: str, index: int) -> str:
    """``base`` with its database number lowered by the worker's index (gw0 keeps it, gw1 takes one less,
    ...), so parallel workers never share Celery's queues, results or broadcast channel."""
    parsed = urlparse(base)
    db = int(parsed.path.lstrip("/") or 0) - index
    if not 0 <= db < REDIS_DATABASES:
        raise pytest.UsageError(f"no Redis database for xdist worker {index} below {base}: run fewer workers")
    return parsed._replace(path=f"/{db}").geturl()


def share_cores_between_workers() -> None:
    """In an xdist worker, give this process and every process it starts (API servers, rlrun workers, ranks)
    ``cores // workers`` threads, as trainer/rank_launch.py does for ranks. With torch's default of one
    thread per core in every worker, their OpenMP pools fight over the cores: the demo's RL test took 569 s
    beside the other worker's tests and 75 s alone (89 s alone on one thread, with the same accuracies)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not XDIST_WORKER or workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by torch when it is first imported
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


share_cores_between_workers()
REDIS_URL = redis_url_for_worker(
    os.environ.get("RLRUN_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"), WORKER_INDEX
)
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


# Files whose tests start servers, worker processes or browsers, or train for long: handed out first, so the
# last file a worker takes is a short one (longest-first keeps the two workers' ends close together).
HEAVY_MARKERS = ("integration", "slow")
HEAVY_FOLDERS = ("browser", "integration", "loops")


def file_weight(item: pytest.Item) -> int:
    """0 for the heaviest kind of test file, 1 for training loops, 2 for the rest."""
    if any(item.get_closest_marker(m) for m in HEAVY_MARKERS) or "browser" in item.path.parts:
        return 0
    return 1 if any(folder in item.path.parts for folder in HEAVY_FOLDERS) else 2


def heaviest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place, whole files at a time, heaviest kind first (the order within a kind and
    within a file is kept). Deterministic, so every xdist worker collects the same order."""
    weight: dict[Path, int] = {}
    for item in items:
        weight[item.path] = min(weight.get(item.path, 2), file_weight(item))
    first_seen = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (weight[item.path], first_seen[item.path]))


def check_unique_node_ids(items: list[pytest.Item]) -> None:
    """Stop the run when two tests share a node id: xdist schedules by node id, so it would run one of
    them and count one. (schemathesis' ``schema.parametrize()`` on pytest 9 gives all 49 API operations
    the same id; under ``-n`` one operation ran and "1 passed" was reported. pytest is pinned to 8.4 in
    pyproject.toml until that is mended.)"""
    repeated = sorted(i for i, n in Counter(item.nodeid for item in items).items() if n > 1)
    if repeated:
        raise pytest.UsageError(f"tests share a node id (xdist would run one of each): {repeated[:5]}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    check_unique_node_ids(items)
    heaviest_files_first(items)
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
    """Cache folder where tiny presets are built once per test run: under xdist the folder beside the
    workers' own temporary roots, shared by all of them (a preset is built in a temporary folder and moved
    into place, so a worker never reads half of one)."""
    root = tmp_path_factory.getbasetemp()
    shared = (root.parent if XDIST_WORKER else root) / "tiny-cache"
    shared.mkdir(exist_ok=True)
    return shared
