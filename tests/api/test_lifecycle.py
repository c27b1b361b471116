"""The run lifecycle (api/lifecycle.py): the transition table, each allowed move and its event, refusals,
races between the API and a worker, and the send after commit. On SQLite and PostgreSQL (``session``)."""

from __future__ import annotations

import ast
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api import lifecycle
from api.errors import InvalidTransition
from api.lifecycle import TRANSITIONS
from api.models import FINISHED_STATUSES, RUN_STATUSES, Dataset, Event, Run, utcnow
from api.queue import BrokerHealth
from api.reconciler import reconcile_once
from tests.factories import FakeEnqueue, dpo_spec, make_dataset, make_run

Act = Callable[[Session, Run], Any]


def running(**over: Any) -> dict[str, Any]:
    return {
        "status": "running",
        "worker_id": "w",
        "attempt": 1,
        "lease_expires_at": utcnow() + timedelta(seconds=60),
    } | over


def expired(**over: Any) -> dict[str, Any]:
    return running(lease_expires_at=utcnow() - timedelta(seconds=5), **over)


SETUPS: dict[str, Callable[[], dict[str, Any]]] = {
    "queued": lambda: {"status": "queued"},
    "running": running,
    "running, lease expired": expired,
    "running, held by another worker": lambda: running(worker_id="other"),
    "running, cancel requested": lambda: running(cancel_requested=True),
    "paused": lambda: {"status": "paused"},
    "succeeded": lambda: {"status": "succeeded", "finished_at": utcnow(), "output_path": "/tmp/x"},
    "failed": lambda: {"status": "failed", "finished_at": utcnow(), "error": "E: boom"},
    "cancelled": lambda: {"status": "cancelled", "finished_at": utcnow(), "cancel_requested": True},
}


def claim(s: Session, r: Run) -> bool:
    return lifecycle.claim(s, r.id, "w2", lease_seconds=60, now=utcnow())


def finish(status: str, **kw: Any) -> Act:
    return lambda s, r: lifecycle.finish(s, r.id, "w", status=status, **kw)


def release_paused(s: Session, r: Run) -> bool:
    return lifecycle.release_paused(s, r.id, "w")


def recover_lost(s: Session, r: Run) -> str | None:
    return lifecycle.recover_lost(s, r, now=utcnow(), max_attempts=3)


def cancel(s: Session, r: Run) -> Run:
    return lifecycle.cancel_run(session=s, run=r)


def pause(s: Session, r: Run) -> Run:
    return lifecycle.pause_run(session=s, run=r)


def resume(s: Session, r: Run) -> Run:
    return lifecycle.resume_run(session=s, run=r)


def new_run(dataset: Dataset) -> Run:
    spec = dpo_spec(dataset.id)
    return Run(id=uuid.uuid4(), algorithm="dpo", spec=spec, dataset_id=dataset.id, created_at=utcnow())


# (from, to, who, setup, action, the event's data)
MOVES: list[tuple[str | None, str, str, str | None, Act, dict[str, Any] | None]] = [
    (None, "queued", "submit", None, lambda s, r: lifecycle.add_queued_run(s, r), None),
    (
        None,
        "cancelled",
        "a stage that never starts",
        None,
        lambda s, r: lifecycle.add_cancelled_run(s, r, "x"),
        {"reason": "x"},
    ),
    ("queued", "running", "claim", "queued", claim, {"worker": "w2", "attempt": 1}),
    (
        "running",
        "running",
        "claim of an expired lease",
        "running, lease expired",
        claim,
        {"worker": "w2", "attempt": 2},
    ),
    ("queued", "paused", "pause", "queued", pause, {"reason": "paused before it started"}),
    ("queued", "cancelled", "cancel", "queued", cancel, {"reason": "cancelled before it started"}),
    (
        "running",
        "succeeded",
        "finish",
        "running",
        finish("succeeded", output_path="/o"),
        {"output_path": "/o"},
    ),
    ("running", "failed", "finish", "running", finish("failed", error="E: x"), {"error": "E: x"}),
    ("running", "cancelled", "finish", "running, cancel requested", finish("cancelled"), None),
    ("running", "paused", "release after a pause", "running", release_paused, {"step": 0}),
    ("running", "queued", "reconciler", "running, lease expired", recover_lost, None),
    ("running", "failed", "reconciler", "running, lease expired", recover_lost, None),
    ("running", "cancelled", "reconciler", "running, lease expired", recover_lost, None),
    ("paused", "queued", "resume", "paused", resume, {"reason": "resumed by the user"}),
    ("paused", "cancelled", "cancel", "paused", cancel, {"reason": "cancelled before it started"}),
]
# What the reconciler's three outcomes need on top of an expired lease.
RECONCILER_EXTRA = {"queued": {}, "failed": {"lost_workers": 2}, "cancelled": {"cancel_requested": True}}


def events(session: Session, run_id: uuid.UUID) -> list[Event]:
    return list(session.scalars(select(Event).where(Event.run_id == run_id).order_by(Event.id)))


def row(session: Session, run_id: uuid.UUID) -> tuple[Any, ...]:
    cols = (
        Run.status,
        Run.cancel_requested,
        Run.pause_requested,
        Run.worker_id,
        Run.attempt,
        Run.finished_at,
    )
    return tuple(session.execute(select(*cols).where(Run.id == run_id)).one())


def test_the_table_names_every_status_and_final_ones_lead_nowhere() -> None:
    assert set(TRANSITIONS) == {None, *RUN_STATUSES}
    assert all(to in RUN_STATUSES for targets in TRANSITIONS.values() for to in targets)
    assert all(not TRANSITIONS[s] for s in FINISHED_STATUSES)
    assert {(f, t) for f, t, *_ in MOVES} == {(f, t) for f, targets in TRANSITIONS.items() for t in targets}


@pytest.mark.parametrize(
    ("source", "to", "who", "setup", "act", "data"), MOVES, ids=lambda v: v if isinstance(v, str) else ""
)
def test_each_allowed_move_writes_its_status_and_event(
    session: Session, source: str | None, to: str, who: str, setup: str | None, act: Act, data: Any
) -> None:
    ds = make_dataset(session)
    if setup is None:
        run = new_run(ds)
    else:
        over = SETUPS[setup]() | (RECONCILER_EXTRA[to] if who == "reconciler" else {})
        run = make_run(session, ds, **over)
        assert run.status == source
    before = len(events(session, run.id)) if setup is not None else 0
    assert act(session, run)
    session.flush()
    status, *_ = row(session, run.id)
    assert status == to
    new = events(session, run.id)[before:]
    assert [(e.kind, e.message) for e in new] == [("status", to)]
    if who == "reconciler":
        assert "lost (lease expired at" in str(new[0].data)
    else:
        assert new[0].data == data
    if to in FINISHED_STATUSES:
        assert row(session, run.id)[5] is not None  # finished_at


# Which setups each move refuses (API: 409 InvalidTransition; worker, reconciler: False/None, no change).
REFUSALS: dict[str, tuple[Act, set[str]]] = {
    "claim": (
        claim,
        {
            "running",
            "running, held by another worker",
            "running, cancel requested",
            "paused",
            *FINISHED_STATUSES,
        },
    ),
    "finish": (
        finish("succeeded"),
        {"queued", "paused", "running, held by another worker", *FINISHED_STATUSES},
    ),
    "release_paused": (
        release_paused,
        {"queued", "paused", "running, held by another worker", *FINISHED_STATUSES},
    ),
    "recover_lost": (
        recover_lost,
        {"running", "running, held by another worker", "running, cancel requested"},
    ),
    "cancel_run": (cancel, set(FINISHED_STATUSES)),
    "pause_run": (pause, {"running, cancel requested", "paused", *FINISHED_STATUSES}),
    "resume_run": (
        resume,
        {"queued", "running", "running, lease expired", "running, cancel requested", *FINISHED_STATUSES},
    ),
}


@pytest.mark.parametrize(
    ("move", "setup"), [(m, s) for m, (_, refused) in REFUSALS.items() for s in sorted(refused)], ids=str
)
def test_forbidden_moves_are_refused_and_change_nothing(session: Session, move: str, setup: str) -> None:
    act, _ = REFUSALS[move]
    run = make_run(session, make_dataset(session), **SETUPS[setup]())
    before, n_events = row(session, run.id), len(events(session, run.id))
    try:
        outcome = act(session, run)
    except InvalidTransition:
        assert move.endswith("_run")  # the API's requests answer 409
    else:
        assert not outcome
    session.flush()
    assert row(session, run.id) == before
    assert len(events(session, run.id)) == n_events


def test_an_edge_outside_the_table_is_a_programming_error(session: Session) -> None:
    run = make_run(session, make_dataset(session), **SETUPS["succeeded"]())
    with pytest.raises(ValueError, match="succeeded -> queued is not a run transition"):
        lifecycle._move(session, run.id, sources=("succeeded",), to="queued")
    with pytest.raises(ValueError, match="succeeded, failed or cancelled"):
        lifecycle.finish(session, run.id, "w", status="paused")


def test_a_second_cancel_or_pause_of_a_running_run_changes_nothing(session: Session) -> None:
    run = make_run(session, make_dataset(session), **running())
    cancel(session, run)
    cancel(session, run)
    other = make_run(session, make_dataset(session), **running())
    pause(session, other)
    pause(session, other)
    session.flush()
    assert [e.kind for e in events(session, run.id)] == ["cancel_requested"]
    assert [e.kind for e in events(session, other.id)] == ["pause_requested"]
    assert row(session, run.id)[:2] == ("running", True) and row(session, other.id)[2] is True


# Races: the API holds a row it read before a worker changed it (a real second connection).


def stale_run(factory: sessionmaker[Session], api: Session, **over: Any) -> Run:
    """A run made and committed, then read by ``api``, whose transaction ends: the object stays as read."""
    with factory.begin() as s:
        run_id = make_run(s, make_dataset(s), **over).id
    run = api.get_one(Run, run_id)
    api.commit()
    return run


def test_a_cancel_that_finds_the_run_claimed_meanwhile_asks_the_worker_to_stop(
    committing_factory: sessionmaker[Session],
) -> None:
    with committing_factory() as api:
        run = stale_run(committing_factory, api)
        with committing_factory.begin() as worker:
            assert lifecycle.claim(worker, run.id, "w", lease_seconds=60, now=utcnow())
        assert run.status == "queued"  # what the API read
        lifecycle.cancel_run(session=api, run=run)
        api.commit()
        assert (run.status, run.cancel_requested) == ("running", True)
    with committing_factory() as s:
        assert row(s, run.id)[:4] == ("running", True, False, "w")  # the claim stands; the worker stops
        assert [(e.kind, e.message) for e in events(s, run.id)] == [
            ("status", "running"),
            ("cancel_requested", "cancel requested; the worker stops within seconds"),
        ]


def test_a_cancel_racing_a_finish_answers_409_and_the_finish_stands(
    committing_factory: sessionmaker[Session],
) -> None:
    with committing_factory() as api:
        run = stale_run(committing_factory, api, **running())
        with committing_factory.begin() as worker:
            assert lifecycle.finish(worker, run.id, "w", status="succeeded", output_path="/o")
        with pytest.raises(InvalidTransition, match="already ended succeeded"):
            lifecycle.cancel_run(session=api, run=run)
        run_id = run.id
    with committing_factory() as s:
        assert row(s, run_id)[:2] == ("succeeded", False)
        assert [e.message for e in events(s, run_id)] == ["succeeded"]


def test_a_resume_of_a_run_cancelled_meanwhile_is_refused(committing_factory: sessionmaker[Session]) -> None:
    with committing_factory() as api, committing_factory() as other:
        run = stale_run(committing_factory, api, status="paused")
        lifecycle.cancel_run(session=other, run=other.get_one(Run, run.id))
        other.commit()
        with pytest.raises(InvalidTransition, match="is cancelled; only paused runs resume"):
            lifecycle.resume_run(session=api, run=run)


def test_a_worker_whose_run_was_taken_over_cannot_end_or_pause_it(
    committing_factory: sessionmaker[Session],
) -> None:
    with committing_factory.begin() as s:
        run_id = make_run(s, make_dataset(s), **expired()).id
    with committing_factory.begin() as s:
        assert lifecycle.claim(s, run_id, "w2", lease_seconds=60, now=utcnow())
    with committing_factory.begin() as s:
        assert not lifecycle.finish(s, run_id, "w", status="failed", error="E: late")
        assert not lifecycle.release_paused(s, run_id, "w")
    with committing_factory() as s:
        assert row(s, run_id)[:4] == ("running", False, False, "w2")
        assert [e.message for e in events(s, run_id)] == ["running"]


# Commit, then enqueue: one helper, used by every path that sends.


def test_a_failed_send_leaves_a_warning_and_marks_the_run_unsent(session: Session) -> None:
    run = make_run(session, make_dataset(session), enqueued_at=utcnow())
    session.commit()
    ok, down = FakeEnqueue(), FakeEnqueue(fail=True)
    assert lifecycle.send_committed(session=session, enqueue=ok, runs=[run]) == []
    assert ok.sent == [run.id] and events(session, run.id) == []
    assert lifecycle.send_committed(session=session, enqueue=down, runs=[run]) == [run.id]
    assert [(e.kind, e.message) for e in events(session, run.id)] == [
        ("warning", "could not reach the broker: ConnectionError")
    ]
    assert run.enqueued_at is None
    assert session.scalar(select(Run.enqueued_at).where(Run.id == run.id)) is None


def test_the_reconciler_sends_through_the_same_helper(committing_factory: sessionmaker[Session]) -> None:
    with committing_factory.begin() as s:
        run_id = make_run(s, make_dataset(s), **expired()).id
    report = reconcile_once(
        committing_factory,
        FakeEnqueue(fail=True),
        max_attempts=3,
        resend_after_seconds=60,
        health=BrokerHealth(),
    )
    assert report.requeued == [run_id] and report.sent == [run_id]
    with committing_factory() as s:
        assert [(e.kind, e.message) for e in events(s, run_id)] == [
            ("status", "queued"),
            ("warning", "could not reach the broker: ConnectionError"),
        ]
        assert s.scalar(select(Run.enqueued_at).where(Run.id == run_id)) is None


# Nothing else writes a run's status.

ROOT = Path(__file__).resolve().parents[2]


def status_writes(source: str) -> list[int]:
    """Lines that set a run's status: ``run.status = ...`` (any target naming a run), ``Run(status=...)``
    or ``.values(status=...)``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == "status" and "run" in ast.unparse(t.value).lower():
                lines.append(t.lineno)
        if isinstance(node, ast.Call) and any(k.arg == "status" for k in node.keywords):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("Run", "values"):
                lines.append(node.lineno)
    return lines


def test_only_the_lifecycle_module_writes_a_run_status() -> None:
    sample = "run.status = 'x'\nr.x, run.status = 1, 2\nRun(status='q')\nupdate(Run).values(status=1)\n"
    assert sorted(status_writes(sample)) == [1, 2, 3, 4]
    assert (
        status_writes("pipeline.status = 'failed'\ndelivery.status = 'ok'\nWebhookDelivery(status='p')\n")
        == []
    )
    files = [*sorted((ROOT / "api").rglob("*.py")), ROOT / "trainer" / "worker.py"]
    found = {
        str(f.relative_to(ROOT)): lines
        for f in files
        if f.name != "lifecycle.py" and (lines := status_writes(f.read_text()))
    }
    assert found == {}
