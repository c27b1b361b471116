"""kombu's SQL transport (the embedded broker, ``sqla+sqlite://``) with two changes for rlrun.

- It polls every ``polling_interval`` seconds (set from ``RLRUN_BROKER_POLLING_INTERVAL``; kombu's
  default is 1 s, which delays every run's start by up to a second).
- A worker stops promptly. Celery's blocking loop (``synloop``, used for transports without async
  support, as this one) drains for 2 s at a time, and after a warm shutdown is asked it still runs one
  more full drain (``try: maybe_shutdown() finally: _loop_cycle()`` in celery/worker/loops.py). With the
  stock transport an idle `rlrun worker` took 3.5 s to stop on SIGTERM (1.5 s on Redis, whose loop is
  async). Here a drain is cut into short slices and ends as soon as the worker is stopping, so an idle
  worker stops as fast as on Redis. A task in progress is not affected: the solo pool runs it in this
  same loop, between drains.

- Two processes that reach a new broker file at once (`rlrun serve`'s API sending the first run while its
  worker starts) both get their tables and queue row. kombu creates them with check-then-create, which
  lets the slower process fail: on its queue row with an IntegrityError, which kombu does not treat as a
  connection error, so a worker starting up stopped with Celery's "Unrecoverable error" and the runs sat
  queued (seen in CI); on its tables with "already exists". Here the loser uses what the winner made.

:func:`register` makes the ``sqla`` URL prefix resolve to this class in the current process.
"""

from __future__ import annotations

from time import monotonic
from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import sqlalchemy as kombu_sqla
from kombu.transport.sqlalchemy import models as kombu_models
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError, OperationalError

# The longest a drain runs before it looks at the worker's shutdown flags again.
SHUTDOWN_CHECK_SECONDS = 0.2


def _worker_is_stopping() -> bool:
    from celery.worker import state

    # The flags hold an exit code once set, often 0: compare by identity, as state.maybe_shutdown does.
    return any(flag is not None and flag is not False for flag in (state.should_stop, state.should_terminate))


# How often a table creation that lost a race with another process is tried again (it then finds them).
CREATE_TABLE_TRIES = 5


def create_tables(engine: Engine) -> None:
    """kombu's queue and message tables on ``engine``, where another process may be creating them too."""
    for attempt in range(CREATE_TABLE_TRIES):
        try:
            kombu_models.metadata.create_all(engine)
            return
        except OperationalError as exc:
            if "already exists" not in str(exc) or attempt == CREATE_TABLE_TRIES - 1:
                raise


class Channel(kombu_sqla.Channel):
    def _engine_from_config(self) -> Engine:
        engine: Engine = super()._engine_from_config()  # type: ignore[no-untyped-call]
        create_tables(engine)  # kombu's own create_all that follows then finds them
        return engine

    def _queue_row(self, queue: str) -> Any:
        return self.session.query(self.queue_cls).filter(self.queue_cls.name == queue).first()

    def _get_or_create(self, queue: str) -> Any:
        """The queue's row, created if missing; where another process created it first, theirs."""
        row = self._queue_row(queue)
        if row is not None:
            return row
        row = self.queue_cls(queue)
        self.session.add(row)
        try:
            self.session.commit()
        except (IntegrityError, OperationalError):
            self.session.rollback()
            row = self._queue_row(queue)
            if row is None:  # not a lost race (a lock held past the timeout): kombu's retry handles it
                raise
        return row


class Transport(kombu_sqla.Transport):
    Channel = Channel

    def drain_events(self, connection: Any, timeout: float | None = None) -> Any:  # type: ignore[override]
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            if _worker_is_stopping():
                raise TimeoutError()
            left = SHUTDOWN_CHECK_SECONDS if deadline is None else deadline - monotonic()
            if left <= 0:
                raise TimeoutError()
            try:
                return super().drain_events(  # type: ignore[no-untyped-call]
                    connection, timeout=min(left, SHUTDOWN_CHECK_SECONDS)
                )
            except TimeoutError:
                continue


def register(polling_interval: float) -> None:
    """Route ``sqla+...`` broker URLs in this process to :class:`Transport`, polling every
    ``polling_interval`` seconds."""
    Transport.polling_interval = polling_interval
    TRANSPORT_ALIASES["sqla"] = f"{__name__}:Transport"
