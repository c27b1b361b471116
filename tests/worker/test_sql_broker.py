"""The embedded broker's transport (api/sql_broker.py): still a working queue, and a drain that ends as
soon as the worker is asked to stop (Celery sets the flag to the exit code, 0 on a warm shutdown)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery.worker import state
from kombu import Connection, Exchange, Queue

from api import sql_broker
from api.queue import make_celery
from api.settings import Settings


@pytest.fixture
def connection(tmp_path: Path) -> Iterator[Connection]:
    settings = Settings(home=tmp_path)
    make_celery(settings)  # registers the transport for sqla+ URLs, as the API and the worker do
    with Connection(settings.resolved_broker_url) as conn:
        yield conn


@pytest.fixture
def stop_flags() -> Iterator[None]:
    before = state.should_stop, state.should_terminate
    yield
    state.should_stop, state.should_terminate = before


def test_sqla_urls_resolve_to_the_transport_with_the_configured_polling(connection: Connection) -> None:
    assert isinstance(connection.transport, sql_broker.Transport)
    assert connection.transport.polling_interval == Settings().broker_polling_interval


def test_a_message_sent_is_delivered_through_the_sliced_drain(connection: Connection) -> None:
    queue = Queue("q", Exchange("q"), routing_key="q")
    got: list[object] = []
    with connection.Consumer(queue, callbacks=[lambda body, msg: (got.append(body), msg.ack())]):
        connection.Producer().publish({"run": 1}, exchange=queue.exchange, routing_key="q", declare=[queue])
        # more than one slice may pass before the row is seen; the deadline is the caller's timeout
        connection.drain_events(timeout=5)
    assert got == [{"run": 1}]


def test_an_empty_drain_waits_for_its_whole_timeout_while_the_worker_runs(connection: Connection) -> None:
    import time

    queue = Queue("empty", Exchange("empty"), routing_key="empty")
    with connection.Consumer(queue, callbacks=[]):
        start = time.monotonic()
        with pytest.raises(socket.timeout):
            connection.drain_events(timeout=3 * sql_broker.SHUTDOWN_CHECK_SECONDS)
        # not cut short at the first slice: the caller's timeout holds
        assert time.monotonic() - start >= 3 * sql_broker.SHUTDOWN_CHECK_SECONDS


@pytest.mark.parametrize("flag", ["should_stop", "should_terminate"])
def test_a_drain_ends_without_polling_once_a_shutdown_is_asked(
    connection: Connection, stop_flags: None, flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = Queue("idle", Exchange("idle"), routing_key="idle")
    polls: list[float | None] = []
    original = sql_broker.kombu_sqla.Transport.drain_events

    def counted(self: object, conn: object, timeout: float | None = None) -> object:
        polls.append(timeout)
        return original(self, conn, timeout=timeout)

    monkeypatch.setattr(sql_broker.kombu_sqla.Transport, "drain_events", counted)
    with connection.Consumer(queue, callbacks=[]):
        setattr(state, flag, 0)  # EX_OK: the value Celery's SIGTERM handler sets (falsy, yet set)
        with pytest.raises(socket.timeout):
            connection.drain_events(timeout=2.0)  # synloop's drain after the shutdown was asked
    assert polls == []
