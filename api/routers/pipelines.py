"""/v1/pipelines: chain runs (SFT -> reward model -> DPO ...) as one request."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Path

from api.deps import EnqueueDep, ProjectDep, SessionDep, SettingsDep
from api.lifecycle import send_committed
from api.schemas import PipelineCreate
from api.services import pipelines as service
from api.services.runs import get_runs
from rlrun.schemas import ErrorBody, PipelineRead

router = APIRouter(prefix="/v1/pipelines", tags=["pipelines"])
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (404, 409, 422)}


@router.post("", status_code=201, response_model=PipelineRead, responses=_ERRORS)
def create_pipeline(
    body: PipelineCreate,
    session: SessionDep,
    enqueue: EnqueueDep,
    settings: SettingsDep,
    project_id: ProjectDep,
) -> PipelineRead:
    """Create a pipeline; stages whose inputs are ready start now, the rest as their inputs succeed."""
    pipeline = service.create_pipeline(
        session=session,
        body=body,
        roots=settings.resolved_model_roots,
        allow_hub=settings.allow_hub,
        project_id=project_id,
        worker_devices=settings.worker_devices,
        worker_hosts=settings.worker_hosts,
        engine_python=settings.engine_python,
        engine_url=settings.engine_url,
    )
    created = service.advance(session=session, pipeline_id=pipeline.id)
    session.commit()
    send_committed(session=session, enqueue=enqueue, runs=get_runs(session=session, run_ids=created))
    return service.pipeline_read(session, pipeline)


@router.get("/{pipeline_id}", response_model=PipelineRead, responses=_ERRORS)
def read_pipeline(
    pipeline_id: Annotated[uuid.UUID, Path()], session: SessionDep, project_id: ProjectDep
) -> PipelineRead:
    """A pipeline with each stage's run and status."""
    return service.pipeline_read(
        session, service.get_pipeline(session=session, pipeline_id=pipeline_id, project_id=project_id)
    )


@router.post("/{pipeline_id}/cancel", response_model=PipelineRead, responses=_ERRORS)
def cancel_pipeline(
    pipeline_id: Annotated[uuid.UUID, Path()], session: SessionDep, project_id: ProjectDep
) -> PipelineRead:
    """Cancel the running stage and every stage not yet started; 409 once the pipeline has ended."""
    pipeline = service.get_pipeline(session=session, pipeline_id=pipeline_id, project_id=project_id)
    pipeline = service.cancel_pipeline(session=session, pipeline=pipeline)
    session.commit()
    return service.pipeline_read(session, pipeline)
