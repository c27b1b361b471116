"""The worker survives a busy SQLite database, and stores sampled text with NUL on every backend.

The busy tests hold SQLite's write lock in another connection for about a second. Their engine waits only
100 ms per try (the service waits 30 s; 200 SSE streams once held the lock longer than that), so one
try fails with "database is locked" and only the retry gets through.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event, select, text, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from api.db import make_engine, make_session_factory
from api.models import Event, Metric, Run, RunSample
from tests.factories import make_dataset, make_run
from trainer.worker import DbReporter, LeaseKeeper, finish_run, retry_busy

WORKER = "test-worker"
HOLD_SECONDS = 1.0


@pytest.fixture
def impatient_engine(sqlite_url: str) -> Iterator[Engine]:
    """The migrated test database, on connections that give up after 100 ms of waiting for the lock."""
    engine = make_engine(sqlite_url)

    @event.listens_for(engine, "connect")
    def _short_busy_timeout(dbapi_connection: Any, _record: Any) -> None:  # after api.db's pragmas
        dbapi_connection.execute("PRAGMA busy_timeout=100")

    yield engine
    engine.dispose()


@pytest.fixture
def factory(impatient_engine: Engine) -> sessionmaker[Session]:
    return make_session_factory(impatient_engine)


def running_run(factory: sessionmaker[Session], **over: Any) -> uuid.UUID:
    with factory.begin() as s:
        ds = make_dataset(s)
        return make_run(s, ds, status="running", worker_id=WORKER, **over).id


class WriteLock:
    """Holds SQLite's write lock from another connection (as a busy API would) for ``seconds``."""

    def __init__(self, sqlite_url: str, seconds: float):
        self.path, self.seconds = sqlite_url.removeprefix("sqlite:///"), seconds
        self.held, self.released_at = threading.Event(), 0.0
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def _hold(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        self.held.set()
        time.sleep(self.seconds)
        conn.execute("ROLLBACK")
        self.released_at = time.monotonic()
        conn.close()

    def __enter__(self) -> WriteLock:
        self.thread.start()
        assert self.held.wait(5)
        return self

    def __exit__(self, *_: object) -> None:
        self.thread.join(10)


def test_a_try_alone_fails_while_the_lock_is_held(factory: sessionmaker[Session], sqlite_url: str) -> None:
    """The premise of the tests below: without a retry, the worker's reads die on the held lock."""
    run_id = running_run(factory)
    with WriteLock(sqlite_url, HOLD_SECONDS), pytest.raises(OperationalError, match="database is locked"):
        with factory() as s:
            s.execute(select(Run.cancel_requested).where(Run.id == run_id)).one()


def test_should_stop_and_flush_wait_out_a_held_lock(factory: sessionmaker[Session], sqlite_url: str) -> None:
    run_id = running_run(factory, cancel_requested=True)
    reporter = DbReporter(factory, run_id, WORKER, lease_seconds=60, flush_seconds=3600)
    reporter.log_metrics(1, {"loss": 0.5})
    with WriteLock(sqlite_url, HOLD_SECONDS) as lock:
        assert reporter.should_stop() is True  # the real answer, read after the lock was released
        assert lock.released_at and time.monotonic() >= lock.released_at
    with WriteLock(sqlite_url, HOLD_SECONDS):
        reporter.flush()
    assert reporter.buffer == {}
    with factory() as s:
        assert s.scalars(select(Metric.value).where(Metric.run_id == run_id)).all() == [0.5]
        assert s.scalar(select(Run.step).where(Run.id == run_id)) == 1


def test_finish_records_a_failure_through_a_held_lock(
    factory: sessionmaker[Session], sqlite_url: str
) -> None:
    run_id = running_run(factory)
    with WriteLock(sqlite_url, HOLD_SECONDS):
        assert finish_run(factory, run_id, WORKER, status="failed", error="RuntimeError: boom")
    with factory() as s:
        run = s.get(Run, run_id)
        assert run is not None and (run.status, run.error) == ("failed", "RuntimeError: boom")
        messages = s.scalars(select(Event.message).where(Event.run_id == run_id)).all()
    assert messages == ["failed"]


def test_stop_check_answers_not_yet_when_the_lock_outlasts_its_retries(
    factory: sessionmaker[Session], sqlite_url: str
) -> None:
    run_id = running_run(factory, cancel_requested=True)
    reporter = DbReporter(factory, run_id, WORKER, lease_seconds=60)
    reporter.stop_check_seconds = 0.3
    with WriteLock(sqlite_url, HOLD_SECONDS):
        assert reporter.should_stop() is False  # training goes on; the next step asks again
    assert reporter.should_stop() is True


def test_other_errors_are_not_retried(factory: sessionmaker[Session]) -> None:
    calls = 0

    def broken() -> None:
        nonlocal calls
        calls += 1
        with factory() as s:
            s.execute(text("SELECT * FROM no_such_table"))

    with pytest.raises(OperationalError, match="no such table"):
        retry_busy("test", broken)
    assert calls == 1


def test_samples_with_nul_are_stored_with_the_replacement_character(
    committing_factory: sessionmaker[Session],
) -> None:
    """PostgreSQL refuses U+0000 in text and JSON; both backends store U+FFFD instead."""
    with committing_factory.begin() as s:
        run_id = make_run(s, make_dataset(s), status="running", worker_id=WORKER).id
    reporter = DbReporter(committing_factory, run_id, WORKER, lease_seconds=60)
    sample = {
        "prompt": "1+1=\x00",
        "completion": "2\x00\x00",
        "reward": 1.0,
        "parsed\x00": ["a\x00", {"k": "\x00b"}, 3],
    }
    reporter.log_samples(2, [sample])
    with committing_factory() as s:
        row = s.scalars(select(RunSample).where(RunSample.run_id == run_id)).one()
    assert (row.step, row.prompt, row.completion, row.reward) == (2, "1+1=\ufffd", "2\ufffd\ufffd", 1.0)
    assert row.data == {"parsed\ufffd": ["a\ufffd", {"k": "\ufffdb"}, 3]}
    assert sample["prompt"] == "1+1=\x00"  # the caller's dict is not changed


def test_lease_renewal_waits_out_a_held_lock(factory: sessionmaker[Session], sqlite_url: str) -> None:
    run_id = running_run(factory)
    with factory.begin() as s:
        s.execute(update(Run).where(Run.id == run_id).values(lease_expires_at=None))
    keeper = LeaseKeeper(factory, run_id, WORKER, lease_seconds=60)
    with WriteLock(sqlite_url, HOLD_SECONDS):
        assert keeper.renew_retrying() is True
    with factory() as s:
        assert s.scalar(select(Run.lease_expires_at).where(Run.id == run_id)) is not None
