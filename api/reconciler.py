"""The reconciler: makes the database, the workers and the broker agree again after a fault.

The database is the source of truth (DESIGN); the broker only carries run ids. Each pass first pings the
broker (when the enqueue can), then, in one short transaction:
1. a ``running`` run whose lease expired lost its worker (killed, OOM, machine gone): ``lost_workers``
   goes up by one and it goes back to ``queued`` with an event, and the next worker to claim it resumes
   from its last checkpoint; once it has lost ``max_attempts`` workers it ends ``failed`` with the reason;
   if a cancel was requested it ends ``cancelled``. ``attempt`` (every claim, resumes after a pause
   included) is not the budget: pausing and resuming never fails a run;
2. a ``queued`` run whose id was last sent more than ``resend_after_seconds`` ago is sent again (a lost
   message). After a broker fault (a failed send or ping, a restarted Redis: see ``api.queue``) every
   queued run is sent again on the first pass that reaches the broker, since the broker may have lost
   them all. While the ping fails nothing is sent. A duplicate message is harmless: the claim is atomic.
Then it advances the pipelines of the runs it ended and, once all is committed, sends the ids through
``api.lifecycle.send_committed`` (a failed send leaves a warning event and is a fault, see above).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session, sessionmaker

from api.lifecycle import recover_lost, send_committed
from api.models import Run, utcnow
from api.queue import BROKER_HEALTH, BrokerHealth, Enqueue, Pingable
from api.services.pipelines import advance

log = logging.getLogger("rlrun.reconciler")


@dataclass
class ReconcileReport:
    requeued: list[uuid.UUID] = field(default_factory=list)
    failed: list[uuid.UUID] = field(default_factory=list)
    cancelled: list[uuid.UUID] = field(default_factory=list)
    sent: list[uuid.UUID] = field(default_factory=list)
    broker_down: bool = False  # the ping failed: nothing was sent


def _broker_up(ping: Callable[[], None] | None, health: BrokerHealth) -> bool:
    if ping is None:
        return True  # nothing to ask: a failing send notes the fault instead
    try:
        ping()
    except Exception as exc:  # noqa: BLE001 - an unreachable broker is an expected state here
        health.fault()
        log.warning("broker unreachable (%s); nothing is sent until it answers", exc)
        return False
    return True


def reconcile_once(
    session_factory: sessionmaker[Session],
    enqueue: Enqueue,
    *,
    max_attempts: int,
    resend_after_seconds: float,
    now: datetime | None = None,
    ping: Callable[[], None] | None = None,
    health: BrokerHealth = BROKER_HEALTH,
) -> ReconcileReport:
    """One pass (see the module docstring). Idempotent; safe to run from several processes.

    ``ping`` reaches the broker once or raises; ``health`` holds the faults this process has seen.
    """
    now = now or utcnow()
    report = ReconcileReport(broker_down=not _broker_up(ping, health))
    # Read after the ping, so a fault it just found (a restarted Redis) is covered by this pass.
    resend_all = None if report.broker_down else health.pending()
    ended_in_pipelines: list[uuid.UUID] = []
    to_send: list[Run] = []
    with session_factory.begin() as session:
        expired = session.scalars(
            select(Run)
            .where(Run.status == "running", Run.lease_expires_at < now)
            .with_for_update(skip_locked=True)
        ).all()
        for run in expired:
            status = recover_lost(session, run, now=now, max_attempts=max_attempts)
            if status is None:
                continue
            ended = {"queued": report.requeued, "failed": report.failed, "cancelled": report.cancelled}
            ended[status].append(run.id)
            if run.pipeline_id is not None and status in ("failed", "cancelled"):
                ended_in_pipelines.append(run.pipeline_id)
        if not report.broker_down:
            due = Run.status == "queued"
            if resend_all is None:  # the usual pass: only ids whose message may have been lost
                stale = now - timedelta(seconds=resend_after_seconds)
                due = and_(due, or_(Run.enqueued_at.is_(None), Run.enqueued_at < stale))
            for run in session.scalars(select(Run).where(due).with_for_update(skip_locked=True)):
                run.enqueued_at = now
                to_send.append(run)
    for pipeline_id in ended_in_pipelines:
        with session_factory.begin() as session:
            created = advance(session=session, pipeline_id=pipeline_id)
            if not report.broker_down:  # else queued unsent: a later pass sends it
                to_send += [session.get_one(Run, run_id) for run_id in created]
    report.sent = [run.id for run in to_send]
    with session_factory() as session:  # committed above: now send (a failed send leaves a warning)
        unsent = send_committed(session=session, enqueue=enqueue, runs=to_send)
    if unsent:  # a fault: the next pass that reaches the broker re-sends every queued run
        health.fault()
    if resend_all is not None and not unsent:
        health.settle(resend_all)
        log.info("broker reachable again: re-sent every queued run (%d)", len(report.sent))
    return report


class ReconcilerThread(threading.Thread):
    """Runs ``reconcile_once`` every ``interval`` seconds until stopped (inside ``rlrun serve``); pings
    the broker each pass when ``enqueue`` can (``CeleryEnqueue``)."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        enqueue: Enqueue,
        *,
        interval: float,
        max_attempts: int,
        resend_after_seconds: float,
    ):
        super().__init__(name="rlrun-reconciler", daemon=True)
        self.args = (session_factory, enqueue)
        self.kwargs = {
            "max_attempts": max_attempts,
            "resend_after_seconds": resend_after_seconds,
            "ping": enqueue.ping if isinstance(enqueue, Pingable) else None,
        }
        self.interval = interval
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                report = reconcile_once(*self.args, **self.kwargs)  # type: ignore[arg-type]
                if report.requeued or report.failed or report.cancelled or report.sent:
                    log.info("reconciled: %s", report)
            except Exception:  # noqa: BLE001 - a DB hiccup must not kill the loop
                log.exception("reconcile pass failed")

    def stop(self) -> None:
        self.stopped.set()
