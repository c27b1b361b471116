"""/v1/runs: submit, list, read, cancel, metrics, events."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query
from fastapi.responses import JSONResponse

from api import lifecycle
from api.db import commit_unless_conflict
from api.deps import EnqueueDep, ProjectDep, RunDep, SessionDep, SettingsDep
from api.errors import InvalidRequest
from api.pagination import AfterCursor
from api.services import runs as service
from api.services.pipelines import cancel_run_and_its_pipeline
from api.services.references import check_engine, total_steps
from api.services.runs import RunSort
from api.services.runs import run_read as to_read
from rlrun.schemas import (
    MAX_TAGS,
    ErrorBody,
    EventRead,
    LastMetric,
    MetricColumns,
    MetricRead,
    Page,
    RunRead,
    RunUpdate,
    RunValidation,
    SampleRead,
)
from trainer.specs import ALGORITHMS, MAX_STEP, RunSpec

router = APIRouter(prefix="/v1/runs", tags=["runs"])
# Reads across runs live outside /v1/runs/, where a path segment is a run id (PATCH /v1/runs/<word> would
# be a run update with a bad id, not 405).
metrics_router = APIRouter(prefix="/v1/metrics", tags=["runs"])
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (404, 409, 422)}
Status = Literal["queued", "running", "paused", "succeeded", "failed", "cancelled"]


@router.post(
    "",
    status_code=201,
    response_model=RunRead,
    responses=_ERRORS
    | {200: {"model": RunValidation, "description": "`validate_only`: what the submit would store"}},
)
def create_run(
    spec: RunSpec,
    session: SessionDep,
    enqueue: EnqueueDep,
    settings: SettingsDep,
    project_id: ProjectDep,
    idempotency_key: Annotated[str | None, Header(max_length=160)] = None,
    validate_only: Annotated[
        bool,
        Query(
            description="A dry run: the same checks and errors, and on success (200) the spec as the run "
            "would store it with its step count; nothing is stored or queued."
        ),
    ] = False,
) -> Any:
    """Submit a run; it is stored queued, committed, then sent to a worker."""
    if validate_only:
        return JSONResponse(dry_run(spec, session, settings, project_id).model_dump(mode="json"))
    # Keys are scoped to the project: another project's identical key is a different request.
    scoped_key = f"{project_id}:{idempotency_key}" if idempotency_key else None
    if scoped_key:
        existing = service.find_by_idempotency_key(session=session, key=scoped_key, spec=spec)
        if existing is not None:
            return to_read(existing)
    check_engine(spec, settings.engine_python, engine_url=settings.engine_url)
    run = service.submit_run(
        session=session,
        spec=spec,
        idempotency_key=scoped_key,
        roots=settings.resolved_model_roots,
        allow_hub=settings.allow_hub,
        project_id=project_id,
        max_in_flight=settings.max_runs_in_flight,
        worker_devices=settings.worker_devices,
        worker_hosts=settings.worker_hosts,
    )
    if not commit_unless_conflict(session):  # a concurrent retry with the same key won the insert
        existing = service.find_by_idempotency_key(session=session, key=scoped_key or "", spec=spec)
        if existing is None:
            raise RuntimeError(f"run {run.id} was refused by the database, and no run holds its key")
        return to_read(existing)
    lifecycle.send_committed(session=session, enqueue=enqueue, runs=[run])
    return to_read(run)


def dry_run(
    spec: RunSpec, session: SessionDep, settings: SettingsDep, project_id: uuid.UUID
) -> RunValidation:
    """What ``create_run`` would store for ``spec``, after the same checks (raising the same errors)."""
    check_engine(spec, settings.engine_python, engine_url=settings.engine_url)
    resolved = service.checked_spec(
        session=session,
        spec=spec,
        roots=settings.resolved_model_roots,
        allow_hub=settings.allow_hub,
        project_id=project_id,
        worker_devices=settings.worker_devices,
        worker_hosts=settings.worker_hosts,
    )
    return RunValidation(
        spec=resolved.model_dump(mode="json"),
        total_steps=total_steps(session, resolved),
        tags=spec.tags or [],
        note=spec.note or None,
    )


@router.get("", response_model=Page[RunRead], responses=_ERRORS)
def list_runs(
    session: SessionDep,
    project_id: ProjectDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    after: AfterCursor = None,
    status: Annotated[Status | None, Query(description="Only runs in this status")] = None,
    algorithm: Annotated[
        str | None, Query(description=f"Only runs of this algorithm: one of {', '.join(ALGORITHMS)}")
    ] = None,
    flagged: Annotated[
        bool | None,
        Query(description="true: only runs with warnings (`warnings` not empty); false: only runs without"),
    ] = None,
    sort: Annotated[
        RunSort,
        Query(
            description="Order: a column, `-` first for descending; ties by creation time then id in the "
            "same direction. A cursor continues the sort it came from."
        ),
    ] = "-created_at",
    q: Annotated[
        str | None,
        Query(
            max_length=200,
            description="Only runs whose name, algorithm, model, tags or note contains this (any case), "
            "or whose id starts with it.",
        ),
    ] = None,
    tag: Annotated[
        list[str] | None, Query(max_length=MAX_TAGS, description="Only runs with every one of these tags.")
    ] = None,
) -> Page[RunRead]:
    """List runs, newest first unless `sort` says otherwise."""
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise InvalidRequest(f"algorithm: one of {', '.join(ALGORITHMS)}", field="algorithm")
    found = service.list_runs(
        session=session,
        limit=limit,
        after=after,
        status=status,
        project_id=project_id,
        flagged=flagged,
        sort=sort,
        q=q,
        tags=tag or [],
        algorithm=algorithm,
    )
    return found.as_page(to_read)


@metrics_router.get("/last", response_model=dict[str, dict[str, LastMetric]], responses=_ERRORS)
def last_metrics(
    session: SessionDep,
    project_id: ProjectDep,
    run: Annotated[list[uuid.UUID], Query(min_length=1, max_length=200, description="Run ids (repeat)")],
    key: Annotated[list[str], Query(min_length=1, max_length=50, description="Metric keys (repeat)")],
) -> dict[str, dict[str, LastMetric]]:
    """The last value of each key for each run, in one request (a runs table's key-metric column):
    {run id: {key: {step, value}}}; a key a run never logged is left out, and so is a run of another
    project or none."""
    found = service.last_metrics(session=session, project_id=project_id, run_ids=run, keys=key)
    return {
        str(run_id): {k: LastMetric(step=step, value=value) for k, (step, value) in per_key.items()}
        for run_id, per_key in found.items()
    }


@router.get("/{run_id}", response_model=RunRead, responses=_ERRORS)
def read_run(run: RunDep) -> RunRead:
    """One run with its status and progress."""
    return to_read(run)


@router.patch("/{run_id}", response_model=RunRead, responses=_ERRORS)
def update_run(run: RunDep, update: RunUpdate, session: SessionDep) -> RunRead:
    """Set the run's tags and/or note (in any status); fields left out stay as they are."""
    run = service.update_run(session=session, run=run, update=update)
    session.commit()
    return to_read(run)


@router.post("/{run_id}/cancel", response_model=RunRead, responses=_ERRORS)
def cancel_run(run: RunDep, session: SessionDep) -> RunRead:
    """Cancel a run: at once if queued; a running run stops within seconds, in a step or in a long phase
    (loading, tokenising, reference pass, rollouts, evaluation, final metrics, checkpoint writing);
    409 once it has ended."""
    run = cancel_run_and_its_pipeline(session=session, run=run)
    session.commit()
    return to_read(run)


@router.post("/{run_id}/pause", response_model=RunRead, responses=_ERRORS)
def pause_run(run: RunDep, session: SessionDep) -> RunRead:
    """Pause a run: at once if queued; a running run stops within seconds (between steps it first saves a
    checkpoint of the steps since the last one; inside a long phase it resumes from its last checkpoint)."""
    run = lifecycle.pause_run(session=session, run=run)
    session.commit()
    return to_read(run)


@router.post("/{run_id}/resume", response_model=RunRead, responses=_ERRORS)
def resume_run(run: RunDep, session: SessionDep, enqueue: EnqueueDep) -> RunRead:
    """Queue a paused run again; it continues from its last checkpoint. 409 unless paused."""
    run = lifecycle.resume_run(session=session, run=run)
    session.commit()
    lifecycle.send_committed(session=session, enqueue=enqueue, runs=[run])
    return to_read(run)


@router.get(
    "/{run_id}/metrics",
    response_model=Page[MetricRead] | dict[str, MetricColumns],
    responses=_ERRORS,
)
def list_metrics(
    run: RunDep,
    session: SessionDep,
    key: Annotated[list[str] | None, Query(description="Only these keys (repeat the parameter)")] = None,
    min_step: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
    max_step: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    after: AfterCursor = None,
    max_points: Annotated[
        int | None,
        Query(
            ge=4,
            le=100_000,
            description="Chart mode: at most this many points per key (min-max "
            "downsampled, first and last kept); no paging.",
        ),
    ] = None,
    format: Annotated[
        Literal["rows", "columns"],
        Query(
            description="`rows`: a page of {key, step, value, logged_at}; `columns` (chart mode only, "
            "needs `max_points`): {key: {step: [...], value: [...]}}, each key once."
        ),
    ] = "rows",
    time: Annotated[
        bool, Query(description="With `format=columns`: add `time`, when each point was logged.")
    ] = False,
) -> Any:
    """Metric values ordered by step then key; with `max_points`, a downsampled series per key."""
    if max_points is not None:
        series = service.chart_series(
            session=session,
            run_id=run.id,
            keys=key,
            min_step=min_step,
            max_step=max_step,
            max_points=max_points,
        )
        if format == "columns":  # plain lists: no per-point model to validate
            return JSONResponse(
                service.metric_columns(session=session, run_id=run.id, series=series, with_time=time)
            )
        rows = [
            MetricRead(key=k, step=s, value=v, logged_at=None) for k, pts in series.items() for s, v in pts
        ]
        return Page(data=rows, has_more=False)
    if format == "columns":
        raise InvalidRequest("max_points: format=columns needs max_points (chart mode)", field="max_points")
    found = service.list_metrics(
        session=session,
        run_id=run.id,
        keys=key,
        min_step=min_step,
        max_step=max_step,
        after=after,
        limit=limit,
    )
    return found.as_page(MetricRead.model_validate)


@router.get("/{run_id}/metric-keys", response_model=list[str], responses=_ERRORS)
def list_metric_keys(run: RunDep, session: SessionDep) -> list[str]:
    """The metric keys this run has logged, sorted."""
    return service.metric_keys(session=session, run_id=run.id)


@router.get("/{run_id}/events", response_model=Page[EventRead], responses=_ERRORS)
def list_events(
    run: RunDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: AfterCursor = None,
) -> Page[EventRead]:
    """The run's events in order: status changes, warnings, errors."""
    found = service.list_events(session=session, run_id=run.id, after=after, limit=limit)
    return found.as_page(EventRead.model_validate)


@router.get("/{run_id}/samples", response_model=Page[SampleRead], responses=_ERRORS)
def list_samples(
    run: RunDep,
    session: SessionDep,
    step: Annotated[
        int | None, Query(ge=0, le=MAX_STEP, description="Only samples stored at this step")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    after: AfterCursor = None,
    q: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=200,
            description="Only samples whose prompt or completion contains this (any case), at any step.",
        ),
    ] = None,
) -> Page[SampleRead]:
    """Completions stored during online RL with their rewards (every `sample_every` steps); `data.reference`
    is the prompt's reference answer where its row has one."""
    found = service.list_samples(session=session, run_id=run.id, step=step, after=after, limit=limit, q=q)
    return found.as_page(SampleRead.model_validate)
