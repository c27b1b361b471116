"""Runs on the API side: submit, read, list. Never commits (the router owns the unit of work).

Status changes (cancel, pause, resume, and every other) live in ``api/lifecycle.py``; the names are also
importable from here, where they used to be.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import ColumnElement, String, cast, func, or_, select
from sqlalchemy.orm import Session

from api.errors import IdempotencyConflict, RunNotFound, TooManyRuns
from api.lifecycle import add_event as add_event
from api.lifecycle import add_queued_run
from api.lifecycle import cancel_run as cancel_run
from api.lifecycle import pause_run as pause_run
from api.lifecycle import resume_run as resume_run
from api.lifecycle import send_committed as send_committed
from api.metric_store import chart_points, point_times
from api.model_card import card_datasets, model_card
from api.models import (
    DEFAULT_PROJECT_ID,
    Dataset,
    Event,
    Metric,
    Run,
    RunSample,
    run_tags,
    stored_tags,
    utcnow,
)
from api.pagination import Keyset, Slice, paginate
from api.services.environments import with_environment_source
from api.services.references import (
    check_devices,
    check_learnable,
    check_references,
    total_steps,
    with_default_learning_rate,
)
from rlrun.schemas import Progress, RunRead, RunUpdate, RunWarningRead
from trainer.specs import AnyRunSpec

log = logging.getLogger("rlrun.runs")
RUNS_ORDER = Keyset(Run.created_at, Run.id, desc=True)  # newest first
METRICS_ORDER = Keyset(Metric.step, Metric.key)
EVENTS_ORDER = Keyset(Event.id)
SAMPLES_ORDER = Keyset(RunSample.id)


def find_by_idempotency_key(*, session: Session, key: str, spec: AnyRunSpec) -> Run | None:
    """The run created earlier with ``key``; refuses a key reused for a different spec."""
    run = session.scalars(select(Run).where(Run.idempotency_key == key)).one_or_none()
    asked = spec.model_dump(mode="json")
    if run is not None and asked["hyperparameters"].get("learning_rate") is None:
        # The stored spec holds the learning rate picked at submit for a request that left it out.
        asked["hyperparameters"]["learning_rate"] = run.spec.get("hyperparameters", {}).get("learning_rate")
    stored_env = (run.spec.get("environment") or {}) if run is not None else {}
    asked_env = asked.get("environment") or {}
    if asked_env.get("id") is not None and stored_env.get("id") == asked_env["id"]:
        asked_env["source"] = stored_env.get("source")  # filled in from the stored environment at submit
    if run is not None and run.spec != asked:
        raise IdempotencyConflict(
            "Idempotency-Key was already used for a different run spec", field="Idempotency-Key"
        )
    return run


def checked_spec(
    *,
    session: Session,
    spec: AnyRunSpec,
    roots: Sequence[Path] | None,
    allow_hub: bool,
    project_id: uuid.UUID,
    worker_devices: int | None,
    worker_hosts: int | None = None,
) -> AnyRunSpec:
    """``spec`` as a run would store it (the default learning rate filled in), after the checks every
    submit makes: its references against the project, that it can learn, that its devices fit. Raises
    the submit's errors (each naming its field); stores nothing."""
    check_references(session=session, spec=spec, project_id=project_id, roots=roots, allow_hub=allow_hub)
    check_learnable(spec)
    check_devices(spec, worker_devices, worker_hosts=worker_hosts)
    spec = with_environment_source(session, spec, project_id)
    return with_default_learning_rate(session, spec, roots or [])


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
    worker_devices: int | None = None,
    worker_hosts: int | None = None,
) -> Run:
    """Store a new queued run (flush only), after every reference in it was checked against the project
    (api/services/references.py). ``roots=None``: plain model names were checked earlier."""
    spec = checked_spec(
        session=session,
        spec=spec,
        roots=roots,
        allow_hub=allow_hub,
        project_id=project_id,
        worker_devices=worker_devices,
        worker_hosts=worker_hosts,
    )
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
        spec=spec.model_dump(mode="json"),
        dataset_id=getattr(spec, "dataset_id", None),  # a merge has none
        idempotency_key=idempotency_key,
        attempt=0,
        step=0,
        total_steps=total_steps(session, spec),
        cancel_requested=False,
        created_at=utcnow(),
        pipeline_id=pipeline_id,
        stage=stage,
        tags=stored_tags(spec.tags or []),
        note=spec.note or None,
    )
    add_queued_run(session, run, {"pipeline_id": str(pipeline_id), "stage": stage} if stage else None)
    log.info("run %s queued (%s)", run.id, spec.algorithm)
    return run


def get_run(*, session: Session, run_id: uuid.UUID, project_id: uuid.UUID | None = None) -> Run:
    """The run, if it exists in ``project_id`` (None: any project; the worker's view)."""
    run = session.get(Run, run_id)
    if run is None or (project_id is not None and run.project_id != project_id):
        raise RunNotFound(f"run {run_id} does not exist", field="run_id")
    return run


def get_runs(*, session: Session, run_ids: Sequence[uuid.UUID]) -> list[Run]:
    """These runs, in this order (those the session made are read from its identity map, not the DB)."""
    return [session.get_one(Run, run_id) for run_id in run_ids]


RunSort = Literal[
    "created_at", "-created_at", "name", "-name", "status", "-status", "algorithm", "-algorithm"
]
# Each sort: its column, then created_at and id (unique together), all in the one direction.
RUN_SORTS: dict[str, Keyset] = {
    f"{sign}{column}": (
        RUNS_ORDER
        if column == "created_at" and sign == "-"
        else Keyset(
            *([getattr(Run, column)] if column != "created_at" else []),
            Run.created_at,
            Run.id,
            desc=sign == "-",
        )
    )
    for column in ("created_at", "name", "status", "algorithm")
    for sign in ("", "-")
}
HEX_ID = re.compile(r"[0-9a-f]{4,32}")


def run_search(q: str) -> ColumnElement[bool]:
    """Runs whose name, algorithm, model, tags or note contains ``q`` (any case), or whose id starts with
    it (hex digits, dashes ignored)."""
    needle = q.strip().lower()
    found = [
        func.lower(column).contains(needle, autoescape=True)
        for column in (Run.name, Run.algorithm, Run.tags, Run.note, Run.spec["model"].as_string())
    ]
    hex_id = needle.replace("-", "")
    if HEX_ID.fullmatch(hex_id):
        found.append(func.replace(cast(Run.id, String), "-", "").startswith(hex_id, autoescape=True))
    return or_(*found)


def list_runs(
    *,
    session: Session,
    limit: int,
    after: str | None,
    status: str | None,
    project_id: uuid.UUID = DEFAULT_PROJECT_ID,
    flagged: bool | None = None,
    sort: str = "-created_at",
    q: str | None = None,
    tags: Sequence[str] = (),
    algorithm: str | None = None,
) -> Slice[Run]:
    """The project's runs in ``sort`` order (``after``: a cursor of the previous page of the same sort);
    ``flagged``: only runs with (True) or without (False) warnings; ``q``: ``run_search``; ``tags``: only
    runs with every one of these tags."""
    stmt = select(Run).where(Run.project_id == project_id)
    if status is not None:
        stmt = stmt.where(Run.status == status)
    if algorithm is not None:
        stmt = stmt.where(Run.algorithm == algorithm)
    if flagged is not None:
        stmt = stmt.where(Run.warning_count > 0 if flagged else Run.warning_count == 0)
    if q and q.strip():
        stmt = stmt.where(run_search(q))
    for tag in tags:
        stmt = stmt.where(Run.tags.contains(f",{tag.strip().lower()},", autoescape=True))
    return paginate(session, stmt, RUN_SORTS[sort], limit=limit, cursor=after)


def update_run(*, session: Session, run: Run, update: RunUpdate) -> Run:
    """Replace the run's tags and/or note (the fields ``update`` sets); any status."""
    given = update.model_fields_set
    if "tags" in given:
        run.tags = stored_tags(update.tags or [])
    if "note" in given:
        run.note = update.note or None
    session.flush()
    return run


def list_metrics(
    *,
    session: Session,
    run_id: uuid.UUID,
    keys: list[str] | None,
    min_step: int | None,
    max_step: int | None,
    after: str | None,
    limit: int,
) -> Slice[Metric]:
    """Metric values ordered by (step, key)."""
    stmt = select(Metric).where(Metric.run_id == run_id)
    if keys:
        stmt = stmt.where(Metric.key.in_(keys))
    if min_step is not None:
        stmt = stmt.where(Metric.step >= min_step)
    if max_step is not None:
        stmt = stmt.where(Metric.step <= max_step)
    return paginate(session, stmt, METRICS_ORDER, limit=limit, cursor=after)


def list_events(*, session: Session, run_id: uuid.UUID, after: str | None, limit: int) -> Slice[Event]:
    """The run's events in the order they were written."""
    return paginate(
        session, select(Event).where(Event.run_id == run_id), EVENTS_ORDER, limit=limit, cursor=after
    )


def list_samples(
    *,
    session: Session,
    run_id: uuid.UUID,
    step: int | None,
    after: str | None,
    limit: int,
    q: str | None = None,
) -> Slice[RunSample]:
    """Stored completions in the order they were stored, optionally of one step only, optionally only
    those whose prompt or completion contains ``q`` (any case)."""
    stmt = select(RunSample).where(RunSample.run_id == run_id)
    if step is not None:
        stmt = stmt.where(RunSample.step == step)
    if q:
        needle = q.lower()
        stmt = stmt.where(
            or_(
                func.lower(RunSample.prompt).contains(needle, autoescape=True),
                func.lower(RunSample.completion).contains(needle, autoescape=True),
            )
        )
    return paginate(session, stmt, SAMPLES_ORDER, limit=limit, cursor=after)


def succeeded_runs(*, session: Session, project_id: uuid.UUID, limit: int) -> list[Run]:
    """The project's succeeded runs that have a final model not archived, newest first."""
    stmt = (
        select(Run)
        .where(
            Run.project_id == project_id,
            Run.status == "succeeded",
            Run.output_path.is_not(None),
            Run.model_archived_at.is_(None),
        )
        .order_by(Run.finished_at.desc(), Run.id.desc())
        .limit(limit)
    )
    return list(session.scalars(stmt))


def merges_of(*, session: Session, run: Run) -> list[Run]:
    """The project's merge runs of ``run``'s final model (spec ``model: run:<id>``), newest first."""
    stmt = (
        select(Run)
        .where(Run.project_id == run.project_id, Run.algorithm == "merge")
        .order_by(Run.created_at.desc(), Run.id.desc())
    )
    return [m for m in session.scalars(stmt) if m.spec.get("model") == f"run:{run.id}"]


def merge_state(*, session: Session, run: Run) -> tuple[Run | None, Run | None]:
    """The newest succeeded merge of ``run``'s adapter whose model folder is still on disk (None: none),
    and a merge still on its way (queued, running or paused; None: none)."""
    merges = merges_of(session=session, run=run)
    for merge in merges:
        if merge.status == "succeeded" and merge.output_path and Path(merge.output_path).is_dir():
            return merge, None
    return None, next((m for m in merges if m.status in ("queued", "running", "paused")), None)


def export_model_card(*, session: Session, run: Run, adapter: bool, merged_by: Run | None) -> str:
    """The ``README.md`` an export of ``run``'s model carries (api/model_card.py), its datasets read here;
    ``merged_by``: the merge run whose folder is exported, when one is."""
    lookup = {}
    for key in ("dataset_id", "validation_dataset_id"):
        if value := run.spec.get(key):
            lookup[str(value)] = session.get(Dataset, uuid.UUID(str(value)))
    return model_card(run, card_datasets(run, lookup), adapter=adapter, merged_by=merged_by)


def metric_keys(*, session: Session, run_id: uuid.UUID) -> list[str]:
    return list(
        session.scalars(select(Metric.key).where(Metric.run_id == run_id).distinct().order_by(Metric.key))
    )


def last_metrics(
    *, session: Session, project_id: uuid.UUID, run_ids: Sequence[uuid.UUID], keys: Sequence[str]
) -> dict[uuid.UUID, dict[str, tuple[int, float]]]:
    """Per run of the project among ``run_ids`` (others left out), its last (step, value) of each of
    ``keys`` it has logged: one primary-key lookup per run and key (a GROUP BY would read every point)."""
    visible = session.scalars(select(Run.id).where(Run.id.in_(run_ids), Run.project_id == project_id)).all()
    out: dict[uuid.UUID, dict[str, tuple[int, float]]] = {}
    for run_id in visible:
        found = out.setdefault(run_id, {})
        for key in keys:
            last = session.execute(
                select(Metric.step, Metric.value)
                .where(Metric.run_id == run_id, Metric.key == key)
                .order_by(Metric.step.desc())
                .limit(1)
            ).first()
            if last is not None:
                found[key] = (last.step, last.value)
    return out


def chart_series(
    *,
    session: Session,
    run_id: uuid.UUID,
    keys: list[str] | None,
    min_step: int | None,
    max_step: int | None,
    max_points: int,
) -> dict[str, list[tuple[int, float]]]:
    """Per key (all the run's when None) that has points in range, its (step, value) series in step
    order cut to ``max_points`` (api/metric_store.chart_points: min-max downsampled, long ranges read
    from the chart tiers)."""
    out = {}
    for key in keys or metric_keys(session=session, run_id=run_id):
        if points := chart_points(session, run_id, key, min_step, max_step, max_points):
            out[key] = points
    return out


def metric_columns(
    *, session: Session, run_id: uuid.UUID, series: dict[str, list[tuple[int, float]]], with_time: bool
) -> dict[str, dict[str, list[Any]]]:
    """``chart_series`` as columns: {key: {"step": [...], "value": [...]}}, with ``"time"`` (seconds since
    the epoch each point was logged) when ``with_time``."""
    out: dict[str, dict[str, list[Any]]] = {}
    for key, points in series.items():
        steps = [step for step, _ in points]
        columns: dict[str, list[Any]] = {"step": steps, "value": [value for _, value in points]}
        if with_time:
            times = point_times(session, run_id, key, steps)
            columns["time"] = [times[step].timestamp() for step in steps]
        out[key] = columns
    return out


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
        progress=Progress(
            step=run.step,
            total_steps=run.total_steps,
            phase=run.phase,
            done=run.phase_done,
            total=run.phase_total,
        ),
        warnings=[RunWarningRead.model_validate(w) for w in run.warnings or []],
        tags=run_tags(run.tags or ""),
        note=run.note,
        cancel_requested=run.cancel_requested,
        pause_requested=run.pause_requested,
        error=run.error,
        output_path=run.output_path,
        output_model=(
            f"run:{run.id}"
            if run.status == "succeeded" and run.output_path and run.model_archived_at is None
            else None
        ),
        result=run.result,
        pipeline_id=run.pipeline_id,
        stage=run.stage,
        created_at=run.created_at,
        started_at=run.started_at,
        finished_at=run.finished_at,
    )
