"""The reconciler: makes the database, the workers and the broker agree again after a fault.

The database is the source of truth (DESIGN); the broker only carries run ids. Each pass, in one short
transaction:
1. a ``running`` run whose lease expired lost its worker (killed, OOM, machine gone): it goes back to
   ``queued`` with an event, and the next worker to claim it resumes from its last checkpoint (claiming
   increments ``attempt``); after ``max_attempts`` it ends ``failed`` with the reason; if a cancel was
   requested it ends ``cancelled``;
2. a ``queued`` run whose id was last sent more than ``resend_after_seconds`` ago is sent again (a lost
   message, a flushed or restarted Redis). A duplicate message is harmless: the claim is atomic.
Then, after the commit, it sends the ids and advances the pipelines of runs it ended.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from api.models import Run, utcnow
from api.queue import Enqueue
from api.services.pipelines import advance
from api.services.runs import add_event

log = logging.getLogger("rlrun.reconciler")


@dataclass
class ReconcileReport:
    requeued: list[uuid.UUID] = field(default_factory=list)
    failed: list[uuid.UUID] = field(default_factory=list)
    cancelled: list[uuid.UUID] = field(default_factory=list)
    sent: list[uuid.UUID] = field(default_factory=list)


def reconcile_once(
    session_factory: sessionmaker[Session],
    enqueue: Enqueue,
    *,
    max_attempts: int,
    resend_after_seconds: float,
    now: datetime | None = None,
) -> ReconcileReport:
    """One pass (see the module docstring). Idempotent; safe to run from several processes."""
    now = now or utcnow()
    report = ReconcileReport()
    ended_in_pipelines: list[uuid.UUID] = []
    queues: dict[uuid.UUID, str | None] = {}
    with session_factory.begin() as session:
        expired = session.scalars(
            select(Run)
            .where(Run.status == "running", Run.lease_expires_at < now)
            .with_for_update(skip_locked=True)
        ).all()
        for run in expired:
            lost = (
                f"worker {run.worker_id} lost (lease expired at {run.lease_expires_at:%Y-%m-%d %H:%M:%S} UTC)"
            )
            run.worker_id, run.lease_expires_at = None, None
            if run.cancel_requested:
                run.status, run.finished_at = "cancelled", now
                add_event(session, run.id, "status", "cancelled", {"reason": lost})
                report.cancelled.append(run.id)
            elif run.attempt >= max_attempts:
                run.status, run.finished_at = "failed", now
                run.error = f"{lost}; gave up after {run.attempt} attempts"
                add_event(session, run.id, "status", "failed", {"error": run.error})
                report.failed.append(run.id)
            else:
                run.status, run.enqueued_at = "queued", None
                add_event(
                    session,
                    run.id,
                    "status",
                    "queued",
                    {"reason": f"{lost}; requeued to resume from its last checkpoint"},
                )
                report.requeued.append(run.id)
            if run.pipeline_id is not None and run.status in ("failed", "cancelled"):
                ended_in_pipelines.append(run.pipeline_id)
            log.warning("run %s: %s -> %s", run.id, lost, run.status)
        stale = now - timedelta(seconds=resend_after_seconds)
        queued = session.scalars(
            select(Run)
            .where(Run.status == "queued", or_(Run.enqueued_at.is_(None), Run.enqueued_at < stale))
            .with_for_update(skip_locked=True)
        ).all()
        for run in queued:
            run.enqueued_at = now
            report.sent.append(run.id)
            queues[run.id] = run.spec.get("queue")
    for pipeline_id in ended_in_pipelines:
        with session_factory.begin() as session:
            for run_id in advance(session=session, pipeline_id=pipeline_id):
                report.sent.append(run_id)
                queues[run_id] = session.get(Run, run_id).spec.get("queue")  # type: ignore[union-attr]
    for run_id in report.sent:
        try:
            enqueue(run_id, queue=queues.get(run_id))
        except Exception as exc:  # noqa: BLE001 - the next pass tries again
            log.warning("run %s: re-send failed: %s", run_id, exc)
    return report


class ReconcilerThread(threading.Thread):
    """Runs ``reconcile_once`` every ``interval`` seconds until stopped (inside ``rlrun serve``)."""

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
        self.kwargs = {"max_attempts": max_attempts, "resend_after_seconds": resend_after_seconds}
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
