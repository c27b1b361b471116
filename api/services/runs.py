"""Run lifecycle on the API side: submit, cancel, read. Never commits (the router owns the unit of work).

Status machine: queued -> running -> succeeded | failed | cancelled; queued -> cancelled. Only the
worker moves a run out of ``running``; cancel of a running run sets a flag the worker obeys within a step.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from api.downsample import minmax_downsample
from api.errors import IdempotencyConflict, InvalidTransition, RunNotFound, TooManyRuns
from api.models import DEFAULT_PROJECT_ID, FINISHED_STATUSES, Event, Metric, Run, utcnow
from api.queue import Enqueue
from api.services.references import check_learnable, check_references, with_default_learning_rate
from rlrun.schemas import MetricRead, Progress, RunRead
from trainer.specs import AnyRunSpec

log = logging.getLogger("rlrun.runs")


def add_event(
    session: Session, run_id: uuid.UUID, kind: str, message: str, data: dict[str, object] | None = None
) -> None:
    session.add(Event(run_id=run_id, kind=kind, message=message, data=data))


def send_committed(*, session: Session, enqueue: Enqueue, runs: Iterable[Run]) -> None:
    """Send committed queued runs to the broker (commit, then enqueue: Celery's "Database transactions").

    A send that fails loses nothing: the run stays queued with a warning event, and its ``enqueued_at``
    is cleared so the next reconciler pass, in any process, sends it again without waiting out
    ``resend_after_seconds``. Commits only when a send failed."""
    failed = False
    for run in runs:
        try:
            enqueue(run.id, queue=run.spec.get("queue"))
        except Exception as exc:  # noqa: BLE001 - any broker failure; the run is safe in the DB
            log.warning("run %s: enqueue failed: %s", run.id, exc)
            add_event(session, run.id, "warning", f"could not reach the broker: {type(exc).__name__}")
            run.enqueued_at = None
            failed = True
    if failed:
        session.commit()


def find_by_idempotency_key(*, session: Session, key: str, spec: AnyRunSpec) -> Run | None:
    """The run created earlier with ``key``; refuses a key reused for a different spec."""
    run = session.scalars(select(Run).where(Run.idempotency_key == key)).one_or_none()
    asked = spec.model_dump(mode="json")
    if run is not None and asked["hyperparameters"].get("learning_rate") is None:
        # The stored spec holds the learning rate picked at submit for a request that left it out.
        asked["hyperparameters"]["learning_rate"] = run.spec.get("hyperparameters", {}).get("learning_rate")
    if run is not None and run.spec != asked:
        raise IdempotencyConflict(
            "Idempotency-Key was already used for a different run spec", field="Idempotency-Key"
        )
    return run


def submit_run(
    *,
    session: Session,
    spec: AnyRunSpec,
    idempotency_key: str | None = None,
    pipeline_id: uuid.UUID | None = None,
    stage: str | None = None,
    roots: Sequence[Path] | None = None,
    allow_hub: bool = False,
    project_id: uuid.UUID = DEFAULT_PROJECT_ID,
    max_in_flight: int | None = None,
) -> Run:
    """Store a new queued run (flush only), after every reference in it was checked against the project
    (api/services/references.py). ``roots=None``: plain model names were checked earlier."""
    check_references(session=session, spec=spec, project_id=project_id, roots=roots, allow_hub=allow_hub)
    check_learnable(spec)
    spec = with_default_learning_rate(session, spec, roots or [])
    if max_in_flight is not None:
        in_flight = session.scalar(
            select(func.count())
            .select_from(Run)
            .where(Run.project_id == project_id, Run.status.in_(("queued", "running", "paused")))
        )
        if (in_flight or 0) >= max_in_flight:
            raise TooManyRuns(
                f"the project has {in_flight} runs queued, running or paused (limit {max_in_flight}); "
                "wait for some to end",
                field="project",
            )
    run = Run(
        project_id=project_id,
        id=uuid.uuid4(),
        algorithm=spec.algorithm,
        status="queued",
        spec=spec.model_dump(mode="json"),
        dataset_id=spec.dataset_id,
        idempotency_key=idempotency_key,
        attempt=0,
        step=0,
        total_steps=spec.total_steps,
        cancel_requested=False,
        created_at=utcnow(),
        enqueued_at=utcnow(),
        pipeline_id=pipeline_id,
        stage=stage,
    )
    session.add(run)
    session.flush()
    add_event(
        session,
        run.id,
        "status",
        "queued",
        {"pipeline_id": str(pipeline_id), "stage": stage} if stage else None,
    )
    session.flush()
    log.info("run %s queued (%s)", run.id, spec.algorithm)
    return run


def get_run(*, session: Session, run_id: uuid.UUID, project_id: uuid.UUID | None = None) -> Run:
    """The run, if it exists in ``project_id`` (None: any project; the worker's view)."""
    run = session.get(Run, run_id)
    if run is None or (project_id is not None and run.project_id != project_id):
        raise RunNotFound(f"run {run_id} does not exist", field="run_id")
    return run


def cancel_run(*, session: Session, run: Run) -> Run:
    """A queued or paused run ends cancelled now; a running one gets the flag its worker checks every step."""
    if run.status in FINISHED_STATUSES:
        raise InvalidTransition(f"run {run.id} already ended {run.status}", field="status")
    if run.cancel_requested:
        return run
    run.cancel_requested = True
    if run.status in ("queued", "paused"):
        run.status = "cancelled"
        run.finished_at = utcnow()
        add_event(session, run.id, "status", "cancelled", {"reason": "cancelled before it started"})
        log.info("run %s cancelled while queued", run.id)
    else:
        add_event(session, run.id, "cancel_requested", "cancel requested; the worker stops within one step")
        log.info("run %s cancel requested", run.id)
    session.flush()
    return run


def list_runs(
    *,
    session: Session,
    limit: int,
    after: tuple[datetime, uuid.UUID] | None,
    status: str | None,
    project_id: uuid.UUID = DEFAULT_PROJECT_ID,
) -> list[Run]:
    """Newest first; ``limit + 1`` rows so the caller can tell whether there is more."""
    stmt = (
        select(Run)
        .where(Run.project_id == project_id)
        .order_by(Run.created_at.desc(), Run.id.desc())
        .limit(limit + 1)
    )
    if status is not None:
        stmt = stmt.where(Run.status == status)
    if after is not None:
        created, rid = after
        stmt = stmt.where(or_(Run.created_at < created, and_(Run.created_at == created, Run.id < rid)))
    return list(session.scalars(stmt))


def list_metrics(
    *,
    session: Session,
    run_id: uuid.UUID,
    keys: list[str] | None,
    min_step: int | None,
    max_step: int | None,
    after: tuple[int, str] | None,
    limit: int,
) -> list[Metric]:
    """Ordered by (step, key); ``limit + 1`` rows."""
    stmt = select(Metric).where(Metric.run_id == run_id).order_by(Metric.step, Metric.key).limit(limit + 1)
    if keys:
        stmt = stmt.where(Metric.key.in_(keys))
    if min_step is not None:
        stmt = stmt.where(Metric.step >= min_step)
    if max_step is not None:
        stmt = stmt.where(Metric.step <= max_step)
    if after is not None:
        step, key = after
        stmt = stmt.where(or_(Metric.step > step, and_(Metric.step == step, Metric.key > key)))
    return list(session.scalars(stmt))


def list_events(*, session: Session, run_id: uuid.UUID, after: int | None, limit: int) -> list[Event]:
    stmt = select(Event).where(Event.run_id == run_id).order_by(Event.id).limit(limit + 1)
    if after is not None:
        stmt = stmt.where(Event.id > after)
    return list(session.scalars(stmt))


def metric_keys(*, session: Session, run_id: uuid.UUID) -> list[str]:
    return list(
        session.scalars(select(Metric.key).where(Metric.run_id == run_id).distinct().order_by(Metric.key))
    )


def downsampled_metrics(
    *,
    session: Session,
    run_id: uuid.UUID,
    keys: list[str] | None,
    min_step: int | None,
    max_step: int | None,
    max_points: int,
) -> list[MetricRead]:
    """Per key, the series in step order cut to ``max_points`` by min-max bucketing (api/downsample.py).
    Reads only (step, value) through the (run_id, key, step) primary key; ``logged_at`` is left null."""
    out: list[MetricRead] = []
    for key in keys or metric_keys(session=session, run_id=run_id):
        # Only (step, value): converting 50k timestamps costs more than the rest of the query.
        stmt = select(Metric.step, Metric.value).where(Metric.run_id == run_id, Metric.key == key)
        if min_step is not None:
            stmt = stmt.where(Metric.step >= min_step)
        if max_step is not None:
            stmt = stmt.where(Metric.step <= max_step)
        rows = session.execute(stmt.order_by(Metric.step)).all()
        kept = minmax_downsample(rows, [r.value for r in rows], max_points)
        out += [MetricRead(key=key, step=r.step, value=r.value, logged_at=None) for r in kept]
    return out


def pause_run(*, session: Session, run: Run) -> Run:
    """A queued run is paused now; a running one checkpoints and stops before its next step."""
    if run.status not in ("queued", "running") or run.cancel_requested:
        raise InvalidTransition(
            f"run {run.id} is {run.status}; only queued or running runs pause", field="status"
        )
    if run.status == "queued":
        run.status = "paused"
        add_event(session, run.id, "status", "paused", {"reason": "paused before it started"})
    elif not run.pause_requested:
        run.pause_requested = True
        add_event(session, run.id, "pause_requested", "pause requested; the worker checkpoints and stops")
    session.flush()
    log.info("run %s pause requested (%s)", run.id, run.status)
    return run


def resume_run(*, session: Session, run: Run) -> Run:
    """A paused run goes back to the queue; a worker resumes it from its last checkpoint."""
    if run.status != "paused":
        raise InvalidTransition(f"run {run.id} is {run.status}; only paused runs resume", field="status")
    run.status, run.pause_requested, run.enqueued_at = "queued", False, utcnow()
    add_event(session, run.id, "status", "queued", {"reason": "resumed by the user"})
    session.flush()
    log.info("run %s resumed", run.id)
    return run


def run_read(run: Run) -> RunRead:
    """The API's run object (what GET /v1/runs/{id} and webhooks send)."""
    return RunRead(
        id=run.id,
        name=run.spec.get("name"),
        algorithm=run.algorithm,
        status=run.status,
        spec=run.spec,
        dataset_id=run.dataset_id,
        attempt=run.attempt,
        lost_workers=run.lost_workers,
        progress=Progress(step=run.step, total_steps=run.total_steps),
        cancel_requested=run.cancel_requested,
        pause_requested=run.pause_requested,
        error=run.error,
        output_path=run.output_path,
        pipeline_id=run.pipeline_id,
        stage=run.stage,
        created_at=run.created_at,
        started_at=run.started_at,
        finished_at=run.finished_at,
    )
