"""The reconciler: expired leases go back to queued (or fail after max attempts, or end cancelled);
queued runs whose message may be lost are re-sent."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.models import Event, Run, utcnow
from api.reconciler import reconcile_once
from tests.factories import FakeEnqueue, make_dataset, make_run


def new_run(factory: sessionmaker[Session], **over: Any) -> uuid.UUID:
    with factory.begin() as s:
        return make_run(s, make_dataset(s), **over).id


def state(factory: sessionmaker[Session], run_id: uuid.UUID) -> tuple[Run, list[Event]]:
    with factory() as s:
        run = s.get(Run, run_id)
        events = list(s.scalars(select(Event).where(Event.run_id == run_id).order_by(Event.id)))
    assert run is not None
    return run, events


def test_expired_leases_are_requeued_failed_or_cancelled(committing_factory: sessionmaker[Session]) -> None:
    past, future = utcnow() - timedelta(seconds=5), utcnow() + timedelta(seconds=60)
    lost = new_run(committing_factory, status="running", attempt=1, worker_id="w1", lease_expires_at=past)
    tired = new_run(committing_factory, status="running", attempt=3, worker_id="w2", lease_expires_at=past)
    cancelling = new_run(
        committing_factory,
        status="running",
        attempt=1,
        worker_id="w3",
        lease_expires_at=past,
        cancel_requested=True,
    )
    healthy = new_run(
        committing_factory, status="running", attempt=1, worker_id="w4", lease_expires_at=future
    )
    enqueue = FakeEnqueue()
    report = reconcile_once(committing_factory, enqueue, max_attempts=3, resend_after_seconds=60)
    assert lost in report.requeued and tired in report.failed and cancelling in report.cancelled
    assert healthy not in report.requeued + report.failed + report.cancelled
    run, events = state(committing_factory, lost)
    assert (run.status, run.worker_id, run.attempt) == ("queued", None, 1)  # the next claim makes it 2
    assert "requeued to resume from its last checkpoint" in events[-1].data["reason"]  # type: ignore[index]
    assert lost in enqueue.sent  # requeued runs are sent at once
    run, _ = state(committing_factory, tired)
    assert run.status == "failed" and "gave up after 3 attempts" in (run.error or "")
    assert state(committing_factory, cancelling)[0].status == "cancelled"
    assert state(committing_factory, healthy)[0].status == "running"


def test_stale_queued_runs_are_resent_once_per_interval(committing_factory: sessionmaker[Session]) -> None:
    stale = new_run(committing_factory, enqueued_at=utcnow() - timedelta(seconds=120))
    fresh = new_run(committing_factory, enqueued_at=utcnow())
    enqueue = FakeEnqueue()
    reconcile_once(committing_factory, enqueue, max_attempts=3, resend_after_seconds=60)
    assert stale in enqueue.sent and fresh not in enqueue.sent
    again = FakeEnqueue()
    reconcile_once(committing_factory, again, max_attempts=3, resend_after_seconds=60)
    assert stale not in again.sent  # just re-sent: not again until the interval passes


def test_a_broker_error_is_retried_on_the_next_pass(committing_factory: sessionmaker[Session]) -> None:
    run_id = new_run(committing_factory, enqueued_at=None)
    reconcile_once(committing_factory, FakeEnqueue(fail=True), max_attempts=3, resend_after_seconds=0.01)
    ok = FakeEnqueue()
    later = utcnow() + timedelta(seconds=1)
    reconcile_once(committing_factory, ok, max_attempts=3, resend_after_seconds=0.01, now=later)
    assert run_id in ok.sent
