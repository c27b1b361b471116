"""The Celery app's configuration and the API's one use of it: send a run id by task name.

The API never imports ``trainer.worker`` (no torch in the API process); it sends ``rlrun.train_run``
by name. The broker carries only run ids; the database decides who runs what (DESIGN).

A send that fails, a ping that fails and a Redis that restarted (its ``run_id`` changed; Redis here keeps
nothing on disk) are *faults*: each may have lost run ids, including ones sent before it. They are noted
process-wide (:data:`BROKER_HEALTH`), and the reconciler in the same process re-sends every queued run on
its first pass once the broker answers again, rather than waiting ``resend_after_seconds``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Protocol, runtime_checkable

from celery import Celery

from api.settings import Settings

TASK_NAME = "rlrun.train_run"
# A worker's part in another worker's multi-host run (trainer/worker_hosts.py): sent by that run's leader.
JOIN_TASK_NAME = "rlrun.join_run"
log = logging.getLogger("rlrun.queue")


class Enqueue(Protocol):
    def __call__(self, run_id: uuid.UUID, queue: str | None = None) -> None: ...


@runtime_checkable
class Pingable(Protocol):
    def ping(self) -> None:
        """Reach the broker once, or raise."""


class BrokerHealth:
    """Faults seen since every queued run was last re-sent (thread-safe; one per process by default)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults = 0  # noted so far: a count, so settling never forgets a fault noted meanwhile
        self._settled = 0  # how many of them a complete re-send covered
        self._server_id: str | None = None

    def fault(self) -> None:
        with self._lock:
            self._faults += 1

    def pending(self) -> int | None:
        """When a fault is not yet covered by a complete re-send: the count to :meth:`settle` afterwards."""
        with self._lock:
            return self._faults if self._faults > self._settled else None

    def settle(self, upto: int) -> None:
        """Every queued run was re-sent after the first ``upto`` faults: forget those, not later ones."""
        with self._lock:
            self._settled = max(self._settled, upto)

    def seen_server(self, server_id: str | None) -> None:
        """The broker answered as ``server_id``; a different one than before restarted empty: a fault."""
        if server_id is None:
            return
        with self._lock:
            if self._server_id is not None and server_id != self._server_id:
                self._faults += 1
            self._server_id = server_id


BROKER_HEALTH = BrokerHealth()


def make_celery(settings: Settings) -> Celery:
    """A Celery app for ``settings`` (no connection is made until a task is sent or a worker starts)."""
    broker = settings.resolved_broker_url
    app = Celery("rlrun", broker=broker, set_as_current=False)
    app.conf.update(
        task_default_queue=settings.queue,
        task_acks_late=True,  # redelivery is harmless: the DB claim lets one delivery run
        task_reject_on_worker_lost=False,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,  # long tasks: never hold a second run hostage
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    if broker.startswith("sqla+"):
        # kombu's SQL transport polls once a second by default, and its transport options are passed to
        # create_engine (so polling can't go there): api/sql_broker.py sets it on its subclass
        # (measured: ~57 ms/task at 0.05 s, no loss in 2,000 messages), which also lets an idle worker
        # stop at once. The sqlite timeout makes a busy queue file wait, not fail.
        from api import sql_broker

        sql_broker.register(settings.broker_polling_interval)
        if broker.startswith("sqla+sqlite"):
            app.conf.broker_transport_options = {"connect_args": {"timeout": 30}}
    return app


class CeleryEnqueue:
    """Sends run ids to the broker by task name; notes faults in ``health``."""

    def __init__(self, settings: Settings, health: BrokerHealth = BROKER_HEALTH):
        self._settings = settings
        self._health = health
        self._app: Celery | None = None

    def _celery(self) -> Celery:
        if self._app is None:
            self._app = make_celery(self._settings)
        return self._app

    def _send(self, task: str, args: list[str], queue: str | None) -> None:
        """Send ``task`` to ``queue``, or the server's default queue; a failure is a broker fault."""
        try:
            self._celery().send_task(task, args=args, queue=queue or self._settings.queue)
        except Exception:
            self._health.fault()
            raise

    def __call__(self, run_id: uuid.UUID, queue: str | None = None) -> None:
        """Send ``run_id`` to ``queue`` (the run spec's), or the server's default queue."""
        self._send(TASK_NAME, [str(run_id)], queue)
        log.info("run %s enqueued", run_id)

    def join(self, run_id: uuid.UUID, token: str, count: int, queue: str | None = None) -> None:
        """Ask ``count`` workers of ``queue`` to join the gathering ``token`` of multi-host run ``run_id``."""
        for _ in range(count):
            self._send(JOIN_TASK_NAME, [str(run_id), token], queue)
        log.info("run %s: %d join task(s) sent", run_id, count)

    def ping(self) -> None:
        """Connect to the broker once, without retries (raises if it is down); note a restarted Redis."""
        try:
            with self._celery().connection_for_write() as conn:
                conn.ensure_connection(max_retries=0)
                server_id = None
                if conn.transport.driver_type == "redis":
                    server_id = str(conn.default_channel.client.info("server")["run_id"])
        except Exception:
            self._health.fault()
            raise
        self._health.seen_server(server_id)
