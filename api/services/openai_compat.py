"""OpenAI's fine-tuning API mapped onto rlrun, the DB side: a file is a dataset, a job is an ``sft`` or
``dpo`` run. Like the other services these take ``session`` keyword-only and never commit (the router
owns the unit of work); the pure translation is ``api/openai_mapping.py``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from sqlalchemy import ColumnElement, Text, and_, cast, exists, func, or_, select
from sqlalchemy.orm import Session

from api.errors import ApiError, DatasetNotFound, FileInUse, FileNotFound, JobNotFound, RunNotFound
from api.lifecycle import add_event
from api.models import Checkpoint, Dataset, DatasetRow, Event, Metric, Pipeline, Run
from api.openai_mapping import (
    CREATED_EVENT,
    FILE_KINDS,
    JOB_ALGORITHMS,
    OPENAI_PARAMS,
    TRAINED_TOKENS,
    job_id,
    metrics_csv_lines,
    parse_checkpoint_step,
    parse_event_id,
    parse_file_id,
    parse_job_id,
    parse_result_file_id,
    plan_job,
)
from api.pagination import Keyset, Slice, paginate
from api.schemas_openai import (
    FineTuningJobCreate,
    Method,
)
from api.services.datasets import get_dataset
from api.services.references import model_params
from api.services.runs import RUNS_ORDER, get_run, metric_keys, submit_run

# OpenAI lists newest first, and name the last object seen (not an opaque cursor) as ``after``.
EVENTS_NEWEST_FIRST = Keyset(Event.id, desc=True)
CHECKPOINTS_NEWEST_FIRST = Keyset(Checkpoint.step, desc=True)
FILES_NEWEST_FIRST = Keyset(Dataset.created_at, Dataset.id, desc=True)
FILES_OLDEST_FIRST = Keyset(Dataset.created_at, Dataset.id)


def get_file(*, session: Session, file: str, project_id: uuid.UUID, param: str) -> Dataset:
    """The dataset behind a ``file-...`` id in the project (an sft or preference one), or FileNotFound."""
    dataset_id = parse_file_id(file)
    try:
        if dataset_id is None:
            raise DatasetNotFound(file)
        dataset = get_dataset(session=session, dataset_id=dataset_id, project_id=project_id)
        if dataset.kind not in FILE_KINDS:
            raise DatasetNotFound(file)
    except DatasetNotFound:
        raise FileNotFound(f"No such File object: {file}", field=param) from None
    return dataset


def get_job(*, session: Session, job: str, project_id: uuid.UUID, param: str) -> Run:
    """The run behind a ``ftjob-...`` id in the project (an sft or dpo run), or JobNotFound."""
    run_id = parse_job_id(job)
    try:
        if run_id is None:
            raise RunNotFound(job)
        run = get_run(session=session, run_id=run_id, project_id=project_id)
        if not is_job(session=session, run=run):
            raise RunNotFound(job)
    except RunNotFound:
        raise JobNotFound(f"No such fine-tuning job: {job}", field=param) from None
    return run


def job_methods(*, session: Session, run_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, Method]:
    """The methods recorded when these jobs were created (runs made elsewhere have none)."""
    stmt = select(Event).where(Event.run_id.in_(run_ids), Event.kind == CREATED_EVENT).order_by(Event.id)
    out: dict[uuid.UUID, Method] = {}
    for event in session.scalars(stmt):
        if event.data and event.run_id not in out:
            out[event.run_id] = Method.model_validate(event.data["method"])
    return out


def list_jobs(*, session: Session, project_id: uuid.UUID, after: str | None, limit: int) -> Slice[Run]:
    """The project's jobs (``job_filter``), newest first, after the job ``after``."""
    key = None
    if after is not None:
        anchor = get_job(session=session, job=after, project_id=project_id, param="after")
        key = RUNS_ORDER.key_of(anchor)
    stmt = select(Run).where(Run.project_id == project_id, job_filter())
    return paginate(session, stmt, RUNS_ORDER, limit=limit, after=key)


def is_job(*, session: Session, run: Run) -> bool:
    """``job_filter`` for one loaded run: only a grpo run needs the query for its creation event."""
    if run.algorithm != "grpo":
        return run.algorithm in JOB_ALGORITHMS
    made_as_job = select(Event.id).where(Event.run_id == run.id, Event.kind == CREATED_EVENT).limit(1)
    return session.scalar(made_as_job) is not None


def job_filter() -> ColumnElement[bool]:
    """Which runs are jobs: every sft and dpo run, and the grpo runs made as reinforcement jobs (they
    carry the job's creation event; a grpo run submitted to /v1/runs is not a job)."""
    made_as_job = exists().where(Event.run_id == Run.id, Event.kind == CREATED_EVENT)
    return or_(
        Run.algorithm.in_([a for a in JOB_ALGORITHMS if a != "grpo"]),
        and_(Run.algorithm == "grpo", made_as_job),
    )


def _id_key(after: str | None, parse: Callable[[str], int | None], what: str) -> tuple[int] | None:
    """The one-column sort key an OpenAI ``after`` id names (``parse`` reads it from the id), None for the
    first page; 400 naming ``after`` when it is not ``what``."""
    if after is None:
        return None
    value = parse(after)
    if value is None:
        raise ApiError(f"after: {after!r} is not {what}", field="after")
    return (value,)


def list_job_events(*, session: Session, run_id: uuid.UUID, after: str | None, limit: int) -> Slice[Event]:
    """A job's events, newest first, after the event ``after`` (``ftevent-...``)."""
    key = _id_key(after, parse_event_id, "an event id (ftevent-...)")
    stmt = select(Event).where(Event.run_id == run_id)
    return paginate(session, stmt, EVENTS_NEWEST_FIRST, limit=limit, after=key)


def list_job_checkpoints(
    *, session: Session, run_id: uuid.UUID, after: str | None, limit: int
) -> Slice[Checkpoint]:
    """A job's kept checkpoints, newest first, after the checkpoint ``after`` (``ftckpt-...``)."""
    key = _id_key(after, parse_checkpoint_step, "a checkpoint id (ftckpt-...)")
    stmt = select(Checkpoint).where(Checkpoint.run_id == run_id)
    return paginate(session, stmt, CHECKPOINTS_NEWEST_FIRST, limit=limit, after=key)


def list_files(
    *, session: Session, project_id: uuid.UUID, after: str | None, limit: int, desc: bool, purpose: str | None
) -> Slice[Dataset]:
    """The project's fine-tuning files (its sft and preference datasets) by creation time, after the file
    ``after``; none for a ``purpose`` other than ``fine-tune``."""
    order = FILES_NEWEST_FIRST if desc else FILES_OLDEST_FIRST
    key = None
    if after is not None:
        anchor = get_file(session=session, file=after, project_id=project_id, param="after")
        key = order.key_of(anchor)
    if purpose not in (None, "fine-tune"):
        return Slice(rows=[], has_more=False, next_cursor=None)
    stmt = select(Dataset).where(Dataset.project_id == project_id, Dataset.kind.in_(FILE_KINDS))
    return paginate(session, stmt, order, limit=limit, after=key)


def create_job(
    *,
    session: Session,
    body: FineTuningJobCreate,
    project_id: uuid.UUID,
    seed: int,
    roots: Sequence[Path],
    max_in_flight: int,
    allow_hub: bool = False,
) -> tuple[Run, Method]:
    """Store the run for a job request (flush only) through ``submit_run``: the same dataset, model
    reference, project and runs-in-flight checks as ``POST /v1/runs``, errors named by OpenAI parameter."""
    training = get_file(
        session=session, file=body.training_file, project_id=project_id, param="training_file"
    )
    validation = (
        get_file(session=session, file=body.validation_file, project_id=project_id, param="validation_file")
        if body.validation_file is not None
        else None
    )
    n_params = model_params(session, body.model, roots)
    spec, method = plan_job(body, training=training, validation=validation, seed=seed, n_params=n_params)
    try:
        run = submit_run(
            session=session,
            spec=spec,
            roots=roots,
            allow_hub=allow_hub,
            project_id=project_id,
            max_in_flight=max_in_flight,
        )
    except ApiError as exc:
        exc.field = OPENAI_PARAMS.get(exc.field or "", exc.field)
        raise
    run.user_metadata = body.metadata
    add_event(
        session,
        run.id,
        CREATED_EVENT,
        f"Created fine-tuning job: {job_id(run.id)}",
        {"method": method.model_dump(mode="json", exclude_none=True)},
    )
    session.flush()
    return run, method


def delete_file(*, session: Session, dataset: Dataset, file: str) -> None:
    """Delete a file's dataset (its rows go with it: ON DELETE CASCADE), unless a run or a running
    pipeline uses it: ``FileInUse`` (409) naming ``file``, the id the caller gave. A run submitted on it
    after this check makes the commit fail (``runs.dataset_id`` is RESTRICT); the caller answers that as
    ``FileInUse`` too."""
    user = file_user(session=session, dataset=dataset)
    if user is not None:
        raise FileInUse(f"{file} is used by {user} and cannot be deleted", field="file_id")
    session.delete(dataset)


def file_user(*, session: Session, dataset: Dataset) -> str | None:
    """What keeps a dataset from being deleted: a run that trains or validates on it, or a running
    pipeline whose later stage will (specs hold dataset ids as text: one LIKE per table finds them)."""
    text = str(dataset.id)
    shown = 5  # runs named in the refusal; more are counted
    runs = session.scalars(
        select(Run.id)
        .where(
            Run.project_id == dataset.project_id,
            or_(Run.dataset_id == dataset.id, cast(Run.spec, Text).contains(text)),
        )
        .order_by(Run.created_at, Run.id)
        .limit(shown + 1)
    ).all()
    if runs:
        named = ", ".join(f"{run} ({job_id(run)})" for run in runs[:shown])
        more = " and more" if len(runs) > shown else ""
        return f"run{'s' if len(runs) > 1 else ''} {named}{more} (runs keep the data they trained on)"
    pipeline = session.scalars(
        select(Pipeline.id)
        .where(
            Pipeline.project_id == dataset.project_id,
            Pipeline.status == "running",
            cast(Pipeline.stages, Text).contains(text),
        )
        .limit(1)
    ).first()
    return f"pipeline {pipeline}" if pipeline is not None else None


def trained_tokens(*, session: Session, run_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, int]:
    """Each run's tokens trained on (the last value of its cumulative ``tokens/trained`` metric)."""
    stmt = (
        select(Metric.run_id, func.max(Metric.value))
        .where(Metric.run_id.in_(run_ids), Metric.key == TRAINED_TOKENS)
        .group_by(Metric.run_id)
    )
    return {run_id: int(value) for run_id, value in session.execute(stmt)}


def get_result_run(*, session: Session, file: str, project_id: uuid.UUID, param: str) -> Run:
    """The succeeded run of the project behind a result file id (``file-results-...``), or FileNotFound."""
    run_id = parse_result_file_id(file)
    run = session.get(Run, run_id) if run_id is not None else None
    if run is None or run.project_id != project_id or run.status != "succeeded":
        raise FileNotFound(f"No such File object: {file}", field=param)
    return run


def result_csv(*, session: Session, run: Run) -> Iterator[str]:
    """The run's metrics as OpenAI's result-file CSV, a line at a time (``metrics_csv_lines``): the keys
    from ``metric_keys``, then the points in step order, read in batches."""
    keys = sorted(metric_keys(session=session, run_id=run.id))  # code-point order on every backend
    rows = session.execute(
        select(Metric.step, Metric.key, Metric.value)
        .where(Metric.run_id == run.id)
        .order_by(Metric.step)
        .execution_options(yield_per=5000)
    )
    return metrics_csv_lines(keys, ((step, key, value) for step, key, value in rows))


def dataset_lines(
    *, factory: Callable[[], AbstractContextManager[Session]], dataset_id: uuid.UUID, page: int = 1000
) -> Iterator[bytes]:
    """A file's content: its stored rows as JSON lines, in upload order (the rows as validated and
    normalised, not the uploaded bytes). Each page of ``page`` rows is read in a session of its own (the
    response streams after the request's session is gone, each chunk maybe on another thread)."""
    last = -1
    while True:
        with factory() as session:
            rows = session.execute(
                select(DatasetRow.index, DatasetRow.data)
                .where(DatasetRow.dataset_id == dataset_id, DatasetRow.index > last)
                .order_by(DatasetRow.index)
                .limit(page)
            ).all()
        if not rows:
            return
        yield b"".join(json.dumps(data, ensure_ascii=False).encode() + b"\n" for _, data in rows)
        last = rows[-1][0]
