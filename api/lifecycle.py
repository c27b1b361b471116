"""The run lifecycle: every status change of a run, the event that goes with it, and the send after commit.

Statuses, and who moves a run from one to the next (``TRANSITIONS`` is the table; ``None`` is "no row
yet"):

    from       to                              by
    (new)      queued                          add_queued_run: a submit, a pipeline stage that starts
    (new)      cancelled                       add_cancelled_run: a pipeline stage that never starts
    queued     running                         claim: a worker
    running    running                         claim: a worker taking over an expired lease
    queued     paused | cancelled              pause_run | cancel_run: the API
    running    succeeded | failed | cancelled  finish: the worker that holds the run
    running    paused                          release_paused: that worker, once a pause stopped it
    running    queued | failed | cancelled     recover_lost: the reconciler, when the lease expired
    running    queued | failed | cancelled     release_lost_rank: the worker, when a rank of its run died
    running    queued | paused | cancelled     release_ungathered: the worker, when a multi-host run's
                                               hosts did not all come
    paused     queued | cancelled              resume_run | cancel_run: the API
    succeeded, failed, cancelled: final.

A running run is never moved by the API: cancel and pause of a running run set ``cancel_requested`` or
``pause_requested``, which its worker obeys within seconds (``finish`` as cancelled, ``release_paused``).

Every change is one conditional UPDATE (``... WHERE status IN (its sources)``, plus the worker's
ownership or the lease's expiry where that matters) and its event is added only when the row matched, so
the worker, the reconciler and the API racing each other (a cancel racing a claim or a finish, two
workers claiming one id) leave one outcome and one event. An API function that loses such a race looks at
the row again and decides anew (a cancel that finds the run claimed meanwhile requests the stop instead).

These functions take the caller's session and never commit (the caller owns the transaction), except
``send_committed``, which runs after the commit: commit, then enqueue (Celery's "Database
transactions"), and a failed send leaves a warning event.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

from sqlalchemy import ColumnElement, case, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from api.errors import InvalidTransition
from api.models import FINISHED_STATUSES, Event, Run, utcnow
from api.queue import Enqueue

log = logging.getLogger("rlrun.lifecycle")

TRANSITIONS: Mapping[str | None, frozenset[str]] = MappingProxyType(
    {
        None: frozenset({"queued", "cancelled"}),
        "queued": frozenset({"running", "paused", "cancelled"}),
        "running": frozenset({"running", "queued", "paused", "succeeded", "failed", "cancelled"}),
        "paused": frozenset({"queued", "cancelled"}),
        "succeeded": frozenset(),
        "failed": frozenset(),
        "cancelled": frozenset(),
    }
)
# An API request that keeps losing races to workers gives up after this many looks at the row.
RACE_TRIES = 3


def add_event(
    session: Session, run_id: uuid.UUID, kind: str, message: str, data: dict[str, Any] | None = None
) -> None:
    session.add(Event(run_id=run_id, kind=kind, message=message, data=data))


def _check(sources: Iterable[str | None], to: str) -> None:
    for source in sources:
        if to not in TRANSITIONS[source]:
            raise ValueError(f"{source or '(new)'} -> {to} is not a run transition")


def _move(
    session: Session,
    run_id: uuid.UUID,
    *,
    sources: Sequence[str],
    to: str,
    guard: Sequence[ColumnElement[bool]] = (),
    values: Mapping[str, Any] | None = None,
) -> bool:
    """``UPDATE runs SET status = to, ... WHERE id = run_id AND status IN sources AND guard``; whether the
    row matched. The edges must be in ``TRANSITIONS``."""
    _check(sources, to)
    stmt = (
        update(Run)
        .where(Run.id == run_id, Run.status.in_(sources), *guard)
        .values(status=to, **(values or {}))
        .execution_options(synchronize_session=False)
    )
    return int(session.execute(stmt).rowcount) == 1  # type: ignore[attr-defined]


def _set_flag(session: Session, run: Run, flag: str) -> bool:
    """Set ``cancel_requested`` or ``pause_requested`` on a running run (no status change)."""
    column = getattr(Run, flag)
    stmt = (
        update(Run)
        .where(Run.id == run.id, Run.status == "running", Run.cancel_requested.is_(False), column.is_(False))
        .values({flag: True})
        .execution_options(synchronize_session=False)
    )
    done = int(session.execute(stmt).rowcount) == 1  # type: ignore[attr-defined]
    return _synced(session, run, done, {flag: True})


def _move_loaded(
    session: Session,
    run: Run,
    *,
    sources: Sequence[str],
    to: str,
    guard: Sequence[ColumnElement[bool]] = (),
    values: Mapping[str, Any] | None = None,
) -> bool:
    """``_move`` for a run loaded in ``session``; ``values`` are plain values, not SQL."""
    values = dict(values or {})
    done = _move(session, run.id, sources=sources, to=to, guard=guard, values=values)
    return _synced(session, run, done, {"status": to, **values})


def _synced(session: Session, run: Run, done: bool, values: Mapping[str, Any]) -> bool:
    """Make ``run`` show what the UPDATE wrote (as committed state: nothing is written twice), or, when
    it matched nothing, what the row holds now."""
    if done:
        for key, value in values.items():
            set_committed_value(run, key, value)
    else:
        session.refresh(run)
    return done


# New rows


def add_queued_run(session: Session, run: Run, data: dict[str, Any] | None = None) -> Run:
    """Store a new run as ``queued`` with its event (flush only); the caller sends it after commit."""
    _check([None], "queued")
    run.status, run.enqueued_at = "queued", utcnow()
    session.add(run)
    session.flush()
    add_event(session, run.id, "status", "queued", data)
    session.flush()
    return run


def add_cancelled_run(session: Session, run: Run, reason: str) -> Run:
    """Store a run that will never start (a pipeline stage after a failed one) as ``cancelled``."""
    _check([None], "cancelled")
    run.status, run.cancel_requested, run.finished_at = "cancelled", True, utcnow()
    session.add(run)
    session.flush()
    add_event(session, run.id, "status", "cancelled", {"reason": reason})
    return run


# The worker's transitions (by id: the worker holds no loaded row)

# A run that is claimed, ends, pauses or loses its worker is in no long phase (``Run.phase``).
NO_PHASE: dict[str, Any] = {"phase": None, "phase_done": None, "phase_total": None}


def claim(session: Session, run_id: uuid.UUID, worker_id: str, *, lease_seconds: int, now: datetime) -> bool:
    """Take ``run_id`` if it is queued or its lease expired: ``running``, held by ``worker_id`` until
    ``now + lease_seconds``, ``attempt`` + 1. True if this worker now holds it."""
    values = {
        "attempt": Run.attempt + 1,
        # Taking over an expired lease (a redelivery that beat the reconciler) is a lost worker too.
        "lost_workers": Run.lost_workers + case((Run.status == "running", 1), else_=0),
        "worker_id": worker_id,
        "lease_expires_at": now + timedelta(seconds=lease_seconds),
        "started_at": now,
        "step": 0,
        "agent_gateway": None,  # a lost worker's gateway is gone: agents wait for this worker's
        "rendezvous": None,  # a multi-host run gathers its hosts anew at each claim
        **NO_PHASE,
    }
    expired = or_(Run.status == "queued", Run.lease_expires_at < now)
    sources = ("queued", "running")
    if not _move(session, run_id, sources=sources, to="running", guard=[expired], values=values):
        return False
    attempt = session.scalar(select(Run.attempt).where(Run.id == run_id))
    add_event(session, run_id, "status", "running", {"worker": worker_id, "attempt": attempt})
    return True


def finish(
    session: Session,
    run_id: uuid.UUID,
    worker_id: str,
    *,
    status: str,
    error: str | None = None,
    output_path: str | None = None,
    result: dict[str, float] | None = None,
) -> bool:
    """End the run ``status`` (succeeded, failed, cancelled) if ``worker_id`` still holds it; one event
    says what happened (the error, or the output path). ``result``: the final metrics its loop returned
    (its finite values: a JSON column, PostgreSQL's JSONB, refuses NaN and infinities)."""
    if status not in FINISHED_STATUSES:
        raise ValueError(f"a run ends succeeded, failed or cancelled, not {status!r}")
    values = {
        "error": error,
        "output_path": output_path,
        "result": {k: v for k, v in (result or {}).items() if math.isfinite(v)} or None,
        "finished_at": utcnow(),
        "lease_expires_at": None,
        **NO_PHASE,
    }
    if not _move(
        session, run_id, sources=("running",), to=status, guard=[Run.worker_id == worker_id], values=values
    ):
        return False
    data = {"error": error} if error else ({"output_path": output_path} if output_path else None)
    add_event(session, run_id, "status", status, data)
    return True


def release_paused(session: Session, run_id: uuid.UUID, worker_id: str) -> bool:
    """The loop stopped for a pause (its checkpoint is saved): ``paused``, held by no worker."""
    values = {"worker_id": None, "lease_expires_at": None, "pause_requested": False, **NO_PHASE}
    if not _move(
        session, run_id, sources=("running",), to="paused", guard=[Run.worker_id == worker_id], values=values
    ):
        return False
    step = session.scalar(select(Run.step).where(Run.id == run_id))
    add_event(session, run_id, "status", "paused", {"step": step})
    return True


def release_ungathered(session: Session, run_id: uuid.UUID, worker_id: str, reason: str) -> str | None:
    """A multi-host run's hosts did not all come within the rendezvous' timeout (none of them trained):
    back to ``queued``, held by no worker, to be gathered again (no worker was lost, so ``lost_workers``
    stays); or ``cancelled`` / ``paused`` where that was asked meanwhile. The new status, or None if
    ``worker_id`` no longer holds it."""
    flags = session.execute(
        select(Run.cancel_requested, Run.pause_requested).where(Run.id == run_id)
    ).one_or_none()
    if flags is None:
        return None
    cancel_requested, pause_requested = flags
    values: dict[str, Any] = {"worker_id": None, "lease_expires_at": None, "rendezvous": None}
    values.update(NO_PHASE)
    if cancel_requested:
        to = "cancelled"
        values["finished_at"] = utcnow()
    elif pause_requested:
        to = "paused"
        values["pause_requested"] = False
    else:
        to = "queued"
        values["enqueued_at"] = None
    if not _move(
        session, run_id, sources=("running",), to=to, guard=[Run.worker_id == worker_id], values=values
    ):
        return None
    add_event(session, run_id, "status", to, {"reason": reason})
    return to


# The reconciler's transition


def recover_lost(session: Session, run: Run, *, now: datetime, max_attempts: int) -> str | None:
    """A running run whose lease expired lost its worker: ``lost_workers`` + 1, and it goes back to
    ``queued`` (the next claim resumes from its last checkpoint), or ends ``cancelled`` if a cancel was
    requested, or ``failed`` once it has lost ``max_attempts`` workers. The new status, or None if the
    run was not (or no longer) running on an expired lease. ``run`` is loaded (and locked) by the caller.
    """
    expiry = run.lease_expires_at
    lost = f"worker {run.worker_id} lost (lease expired at {expiry:%Y-%m-%d %H:%M:%S} UTC)"
    return _requeue_lost(
        session, run, lost, now=now, max_attempts=max_attempts, guard=Run.lease_expires_at < now
    )


def release_lost_rank(
    session: Session, run: Run, worker_id: str, reason: str, *, now: datetime, max_attempts: int
) -> str | None:
    """The lease holder of a multi-rank run lost one of its ranks (it died or raised): the same path as a
    lost worker (``recover_lost``), at once rather than when the lease expires. ``run`` is loaded by the
    caller; None if ``worker_id`` no longer holds it."""
    lost = f"worker {worker_id} lost a rank ({reason})"
    return _requeue_lost(
        session, run, lost, now=now, max_attempts=max_attempts, guard=Run.worker_id == worker_id
    )


def _requeue_lost(
    session: Session, run: Run, lost: str, *, now: datetime, max_attempts: int, guard: Any
) -> str | None:
    lost_workers = run.lost_workers + 1
    values: dict[str, Any] = {
        "worker_id": None,
        "lease_expires_at": None,
        "lost_workers": lost_workers,
        **NO_PHASE,
    }
    if run.cancel_requested:
        to, data = "cancelled", {"reason": lost}
        values["finished_at"] = now
    elif lost_workers >= max_attempts:
        to = "failed"
        values["finished_at"] = now
        values["error"] = f"{lost}; gave up after losing {lost_workers} workers"
        data = {"error": values["error"]}
    else:
        to, data = "queued", {"reason": f"{lost}; requeued to resume from its last checkpoint"}
        values["enqueued_at"] = None
    if not _move_loaded(session, run, sources=("running",), to=to, guard=[guard], values=values):
        return None
    add_event(session, run.id, "status", to, data)
    log.warning("run %s: %s -> %s", run.id, lost, to)
    return to


# The API's requests (on a run loaded in the request's session)


def cancel_run(*, session: Session, run: Run) -> Run:
    """A queued or paused run ends cancelled now; a running one gets the flag its worker checks every
    step. 409 once it has ended; a second cancel of a running run changes nothing."""
    for _ in range(RACE_TRIES):
        if run.status in FINISHED_STATUSES:
            raise InvalidTransition(f"run {run.id} already ended {run.status}", field="status")
        if run.cancel_requested:
            return run
        if run.status in ("queued", "paused"):
            values = {"cancel_requested": True, "finished_at": utcnow()}
            if _move_loaded(session, run, sources=("queued", "paused"), to="cancelled", values=values):
                add_event(session, run.id, "status", "cancelled", {"reason": "cancelled before it started"})
                log.info("run %s cancelled while queued", run.id)
                session.flush()
                return run
        elif _set_flag(session, run, "cancel_requested"):
            message = "cancel requested; the worker stops within seconds"
            add_event(session, run.id, "cancel_requested", message)
            log.info("run %s cancel requested", run.id)
            session.flush()
            return run
    raise InvalidTransition(f"run {run.id} changed while it was being cancelled; try again", field="status")


def pause_run(*, session: Session, run: Run) -> Run:
    """A queued run is paused now; a running one checkpoints and stops before its next step (a second
    pause changes nothing). 409 for any other run, and for one whose cancel was requested."""
    for _ in range(RACE_TRIES):
        if run.status not in ("queued", "running") or run.cancel_requested:
            raise InvalidTransition(
                f"run {run.id} is {run.status}; only queued or running runs pause", field="status"
            )
        if run.status == "queued":
            guard = [Run.cancel_requested.is_(False)]
            if _move_loaded(session, run, sources=("queued",), to="paused", guard=guard):
                add_event(session, run.id, "status", "paused", {"reason": "paused before it started"})
                break
        elif run.pause_requested:
            break
        elif _set_flag(session, run, "pause_requested"):
            message = "pause requested; the worker checkpoints and stops"
            add_event(session, run.id, "pause_requested", message)
            break
    else:
        raise InvalidTransition(f"run {run.id} changed while it was being paused; try again", field="status")
    session.flush()
    log.info("run %s pause requested (%s)", run.id, run.status)
    return run


def resume_run(*, session: Session, run: Run) -> Run:
    """A paused run goes back to the queue (the caller sends it after commit); a worker resumes it from
    its last checkpoint. 409 unless paused."""
    values = {"pause_requested": False, "enqueued_at": utcnow()}
    if run.status != "paused" or not _move_loaded(
        session, run, sources=("paused",), to="queued", values=values
    ):
        raise InvalidTransition(f"run {run.id} is {run.status}; only paused runs resume", field="status")
    add_event(session, run.id, "status", "queued", {"reason": "resumed by the user"})
    session.flush()
    log.info("run %s resumed", run.id)
    return run


# Commit, then enqueue


def send_committed(*, session: Session, enqueue: Enqueue, runs: Iterable[Run]) -> list[uuid.UUID]:
    """Send committed queued runs to the broker (commit, then enqueue: Celery's "Database transactions");
    the ids whose send failed.

    A send that fails loses nothing: the run stays queued with a warning event, and its ``enqueued_at``
    is cleared so the next reconciler pass, in any process, sends it again without waiting out
    ``resend_after_seconds``. ``runs`` may be detached (loaded by a transaction that has ended); the
    warnings are written in ``session``, which is committed only when a send failed."""
    unsent: list[uuid.UUID] = []
    for run in runs:
        try:
            enqueue(run.id, queue=run.spec.get("queue"))
        except Exception as exc:  # noqa: BLE001 - any broker failure; the run is safe in the DB
            log.warning("run %s: enqueue failed: %s", run.id, exc)
            add_event(session, run.id, "warning", f"could not reach the broker: {type(exc).__name__}")
            session.execute(
                update(Run)
                .where(Run.id == run.id)
                .values(enqueued_at=None)
                .execution_options(synchronize_session=False)
            )
            set_committed_value(run, "enqueued_at", None)
            unsent.append(run.id)
    if unsent:
        session.commit()
    return unsent
