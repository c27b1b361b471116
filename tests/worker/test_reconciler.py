"""The reconciler: expired leases go back to queued (or fail after max lost workers, or end cancelled);
queued runs whose message may be lost are re-sent, all of them once the broker answers after a fault."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from kombu.exceptions import OperationalError
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.models import Event, Run, utcnow
from api.queue import BrokerHealth, CeleryEnqueue
from api.reconciler import ReconcilerThread, reconcile_once
from api.services.runs import resume_run
from api.settings import Settings
from tests.factories import FakeEnqueue, make_dataset, make_run
from trainer.ports import free_port
from trainer.worker import claim_run, pause_claimed_run


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
    tired = new_run(
        committing_factory, status="running", attempt=3, lost_workers=2, worker_id="w2", lease_expires_at=past
    )
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
    report = reconcile_once(
        committing_factory, enqueue, max_attempts=3, resend_after_seconds=60, health=BrokerHealth()
    )
    assert lost in report.requeued and tired in report.failed and cancelling in report.cancelled
    assert healthy not in report.requeued + report.failed + report.cancelled
    run, events = state(committing_factory, lost)
    assert (run.status, run.worker_id, run.attempt, run.lost_workers) == ("queued", None, 1, 1)
    assert "requeued to resume from its last checkpoint" in events[-1].data["reason"]  # type: ignore[index]
    assert lost in enqueue.sent  # requeued runs are sent at once
    run, _ = state(committing_factory, tired)
    assert run.status == "failed" and "gave up after losing 3 workers" in (run.error or "")
    assert state(committing_factory, cancelling)[0].status == "cancelled"
    assert state(committing_factory, healthy)[0].status == "running"


def test_stale_queued_runs_are_resent_once_per_interval(committing_factory: sessionmaker[Session]) -> None:
    stale = new_run(committing_factory, enqueued_at=utcnow() - timedelta(seconds=120))
    fresh = new_run(committing_factory, enqueued_at=utcnow())
    enqueue, health = FakeEnqueue(), BrokerHealth()
    reconcile_once(committing_factory, enqueue, max_attempts=3, resend_after_seconds=60, health=health)
    assert stale in enqueue.sent and fresh not in enqueue.sent
    again = FakeEnqueue()
    reconcile_once(committing_factory, again, max_attempts=3, resend_after_seconds=60, health=health)
    assert stale not in again.sent  # just re-sent: not again until the interval passes


def test_a_broker_error_is_retried_on_the_next_pass(committing_factory: sessionmaker[Session]) -> None:
    run_id = new_run(committing_factory, enqueued_at=None)
    health = BrokerHealth()
    reconcile_once(
        committing_factory, FakeEnqueue(fail=True), max_attempts=3, resend_after_seconds=300, health=health
    )
    ok = FakeEnqueue()
    # The failed re-send stamped enqueued_at; the fault makes the next pass send it anyway, not 300 s on.
    reconcile_once(committing_factory, ok, max_attempts=3, resend_after_seconds=300, health=health)
    assert run_id in ok.sent
    assert health.pending() is None  # settled: back to the usual interval
    again = FakeEnqueue()
    reconcile_once(committing_factory, again, max_attempts=3, resend_after_seconds=300, health=health)
    assert run_id not in again.sent


def expire_lease(factory: sessionmaker[Session], run_id: uuid.UUID) -> None:
    """What a killed worker leaves behind: its lease runs out."""
    with factory.begin() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.status == "running"
        run.lease_expires_at = utcnow() - timedelta(seconds=1)


def test_pause_and_resume_do_not_use_up_the_lost_worker_budget(
    committing_factory: sessionmaker[Session],
) -> None:
    run_id = new_run(committing_factory)

    def reconcile() -> Any:
        return reconcile_once(
            committing_factory, FakeEnqueue(), max_attempts=3, resend_after_seconds=60, health=BrokerHealth()
        )

    for _ in range(2):  # claimed, paused (a clean release), resumed: each claim is one more attempt
        assert claim_run(committing_factory, run_id, "w", lease_seconds=60)
        pause_claimed_run(committing_factory, run_id, "w")
        with committing_factory.begin() as s:
            resume_run(session=s, run=s.get(Run, run_id))  # type: ignore[arg-type]
    for lost in (1, 2):
        assert claim_run(committing_factory, run_id, "w", lease_seconds=60)
        expire_lease(committing_factory, run_id)
        assert run_id in reconcile().requeued
        run, _ = state(committing_factory, run_id)
        assert (run.status, run.attempt, run.lost_workers) == ("queued", 2 + lost, lost)
    assert claim_run(committing_factory, run_id, "w", lease_seconds=60)
    expire_lease(committing_factory, run_id)
    assert run_id in reconcile().failed  # the third lost worker, at attempt 5
    run, _ = state(committing_factory, run_id)
    assert (run.status, run.attempt, run.lost_workers) == ("failed", 5, 3)
    assert "gave up after losing 3 workers" in (run.error or "")


class FakeBroker:
    """A ping that fails while the broker is 'down'."""

    def __init__(self) -> None:
        self.up = True

    def ping(self) -> None:
        if not self.up:
            raise ConnectionError("broker down")


def test_once_the_broker_answers_after_a_fault_every_queued_run_is_resent(
    committing_factory: sessionmaker[Session],
) -> None:
    health, broker = BrokerHealth(), FakeBroker()
    # Sent a moment ago, so the usual pass would wait resend_after_seconds: but the broker may have lost it.
    before = new_run(committing_factory, enqueued_at=utcnow())

    def reconcile(enqueue: FakeEnqueue) -> Any:
        return reconcile_once(
            committing_factory,
            enqueue,
            max_attempts=3,
            resend_after_seconds=300,
            ping=broker.ping,
            health=health,
        )

    assert before not in reconcile(FakeEnqueue()).sent  # no fault yet: not due for 300 s
    broker.up = False
    health.fault()  # a submit's send failed meanwhile (CeleryEnqueue notes it)
    during = new_run(committing_factory, enqueued_at=utcnow())
    down = reconcile(FakeEnqueue())
    assert down.broker_down and down.sent == []  # nothing is sent (or stamped) while the ping fails
    broker.up = True
    enqueue = FakeEnqueue()
    up = reconcile(enqueue)
    assert not up.broker_down and {before, during} <= set(enqueue.sent)
    settled = FakeEnqueue()
    reconcile(settled)
    assert before not in settled.sent and during not in settled.sent  # once, not every pass


def test_broker_health_notes_restarts_and_never_forgets_a_later_fault() -> None:
    health = BrokerHealth()
    health.seen_server("redis-a")
    health.seen_server("redis-a")
    assert health.pending() is None
    health.seen_server("redis-b")  # a restarted Redis is empty: whatever it held is lost
    mark = health.pending()
    assert mark is not None
    health.fault()  # noted while the re-send for the first fault was under way
    health.settle(mark)
    assert health.pending() is not None
    health.settle(health.pending() or 0)
    assert health.pending() is None


def test_celery_enqueue_notes_failed_sends_and_pings_and_the_reconciler_pings_with_it() -> None:
    health = BrokerHealth()
    enqueue = CeleryEnqueue(Settings(broker_url=f"redis://127.0.0.1:{free_port()}/0"), health)  # nobody there
    with pytest.raises(OperationalError):
        enqueue.ping()
    assert health.pending() == 1
    with pytest.raises(OperationalError):
        enqueue(uuid.uuid4())  # what a submit does; the router answers 201 with a warning
    assert health.pending() == 2
    thread = ReconcilerThread(sessionmaker(), enqueue, interval=10, max_attempts=3, resend_after_seconds=300)
    assert thread.kwargs["ping"] == enqueue.ping
