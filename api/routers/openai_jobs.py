"""/v1/fine_tuning/jobs, OpenAI-compatible: a job is an rlrun `sft` (supervised) or `dpo` run."""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request

from api import lifecycle
from api import openai_mapping as mapping
from api.deps import EnqueueDep, ProjectDep, SessionDep, SettingsDep
from api.errors import ApiError, InvalidTransition, OpenAIErrorBody
from api.models import Run
from api.schemas_openai import (
    FineTuningJob,
    FineTuningJobCreate,
    JobCheckpointList,
    JobEventList,
    JobList,
)
from api.services import openai_compat as compat
from api.services.pipelines import cancel_run_and_its_pipeline

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["openai"])
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": OpenAIErrorBody} for code in (400, 401, 404, 409, 422, 429)
}
After = Annotated[
    str | None, Query(min_length=1, description="An id from the previous page: the page starts after it.")
]


def load_job(
    fine_tuning_job_id: Annotated[str, Path(description="`ftjob-...`")],
    session: SessionDep,
    project_id: ProjectDep,
) -> Run:
    return compat.get_job(
        session=session, job=fine_tuning_job_id, project_id=project_id, param="fine_tuning_job_id"
    )


JobDep = Annotated[Run, Depends(load_job)]


def _job(session: SessionDep, run: Run) -> FineTuningJob:
    method = compat.job_methods(session=session, run_ids=[run.id]).get(run.id)
    tokens = compat.trained_tokens(session=session, run_ids=[run.id]).get(run.id)
    return mapping.job_object(run, method, tokens)


@router.post("", response_model=FineTuningJob, responses=_ERRORS)
def create_job(
    body: FineTuningJobCreate,
    session: SessionDep,
    enqueue: EnqueueDep,
    settings: SettingsDep,
    project_id: ProjectDep,
) -> FineTuningJob:
    """Create a fine-tuning job: stored as a queued run, committed, then sent to a worker."""
    run, method = compat.create_job(
        session=session,
        body=body,
        project_id=project_id,
        seed=body.seed if body.seed is not None else secrets.randbelow(2**31),  # OpenAI picks one too
        roots=settings.resolved_model_roots,
        allow_hub=settings.allow_hub,
        max_in_flight=settings.max_runs_in_flight,
    )
    session.commit()
    lifecycle.send_committed(session=session, enqueue=enqueue, runs=[run])
    return mapping.job_object(run, method)


@router.get("", response_model=JobList, responses=_ERRORS)
def list_jobs(
    request: Request,
    session: SessionDep,
    project_id: ProjectDep,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> JobList:
    """The project's jobs (its sft and dpo runs), newest first."""
    if any(k == "metadata" or k.startswith("metadata[") for k in request.query_params):
        raise ApiError("filtering jobs by metadata is not supported by rlrun", field="metadata")
    found = compat.list_jobs(session=session, project_id=project_id, after=after, limit=limit)
    ids = [r.id for r in found.rows]
    methods = compat.job_methods(session=session, run_ids=ids)
    tokens = compat.trained_tokens(session=session, run_ids=ids)
    return JobList(
        data=[mapping.job_object(r, methods.get(r.id), tokens.get(r.id)) for r in found.rows],
        has_more=found.has_more,
    )


@router.get("/{fine_tuning_job_id}", response_model=FineTuningJob, responses=_ERRORS)
def retrieve_job(run: JobDep, session: SessionDep) -> FineTuningJob:
    """One job: status, hyperparameters, fine_tuned_model once succeeded."""
    return _job(session, run)


def _refused(action: str, run: Run, session: SessionDep) -> InvalidTransition:
    job = _job(session, run)
    state = (
        f"{job.status}, cancel requested" if run.cancel_requested and job.status == "running" else job.status
    )
    return InvalidTransition(
        f"cannot {action} fine-tuning job {job.id}: it is {state}", field="fine_tuning_job_id"
    )


@router.post("/{fine_tuning_job_id}/cancel", response_model=FineTuningJob, responses=_ERRORS)
def cancel_job(run: JobDep, session: SessionDep) -> FineTuningJob:
    """Cancel: at once if queued or paused, within seconds if running; 409 once it has ended."""
    try:
        run = cancel_run_and_its_pipeline(session=session, run=run)
    except InvalidTransition:
        raise _refused("cancel", run, session) from None
    session.commit()
    return _job(session, run)


@router.post("/{fine_tuning_job_id}/pause", response_model=FineTuningJob, responses=_ERRORS)
def pause_job(run: JobDep, session: SessionDep) -> FineTuningJob:
    """Pause: at once if queued; a running job stops within seconds, checkpointing first between steps
    (`pausing`)."""
    try:
        run = lifecycle.pause_run(session=session, run=run)
    except InvalidTransition:
        raise _refused("pause", run, session) from None
    session.commit()
    return _job(session, run)


@router.post("/{fine_tuning_job_id}/resume", response_model=FineTuningJob, responses=_ERRORS)
def resume_job(run: JobDep, session: SessionDep, enqueue: EnqueueDep) -> FineTuningJob:
    """Queue a paused job again; it continues from its last checkpoint. 409 unless paused."""
    try:
        run = lifecycle.resume_run(session=session, run=run)
    except InvalidTransition:
        raise _refused("resume", run, session) from None
    session.commit()
    lifecycle.send_committed(session=session, enqueue=enqueue, runs=[run])
    return _job(session, run)


@router.get("/{fine_tuning_job_id}/events", response_model=JobEventList, responses=_ERRORS)
def list_job_events(
    run: JobDep, session: SessionDep, after: After = None, limit: Annotated[int, Query(ge=1, le=1000)] = 20
) -> JobEventList:
    """The job's events, newest first: status changes, checkpoints, warnings, the failure reason."""
    found = compat.list_job_events(session=session, run_id=run.id, after=after, limit=limit)
    return JobEventList(data=[mapping.event_object(e) for e in found.rows], has_more=found.has_more)


@router.get("/{fine_tuning_job_id}/checkpoints", response_model=JobCheckpointList, responses=_ERRORS)
def list_job_checkpoints(
    run: JobDep, session: SessionDep, after: After = None, limit: Annotated[int, Query(ge=1, le=1000)] = 10
) -> JobCheckpointList:
    """The job's kept checkpoints, newest first; each is usable as `model` (`run:<id>@<step>`)."""
    found = compat.list_job_checkpoints(session=session, run_id=run.id, after=after, limit=limit)
    data = [mapping.checkpoint_object(c) for c in found.rows]
    return JobCheckpointList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=found.has_more,
    )
