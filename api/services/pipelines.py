"""Pipelines: stages (run specs) that start as the stages they refer to succeed. Never commits.

A stage's model fields may say ``stage:<name>`` for an earlier stage; when that stage's run succeeds the
reference becomes ``run:<its run id>`` and the stage's run is created. ``advance`` is idempotent and is
called after every change that can unblock or doom a stage: creation, a run ending, a cancel.
"""

from __future__ import annotations

import copy
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import InvalidRequest, InvalidTransition, NotFound
from api.lifecycle import add_cancelled_run, add_event, cancel_run
from api.models import DEFAULT_PROJECT_ID, FINISHED_STATUSES, Pipeline, Run, utcnow
from api.schemas import PipelineCreate
from api.services.environments import with_environment_source
from api.services.references import (
    check_devices,
    check_engine,
    check_learnable,
    check_references,
    total_steps,
)
from api.services.runs import submit_run
from rlrun.schemas import PipelineRead, StageRead
from trainer.specs import AnyRunSpec, RunSpec, parse_spec, parse_stage_ref, set_at, spec_references

log = logging.getLogger("rlrun.pipelines")


class PipelineNotFound(NotFound):
    code = "pipeline_not_found"


def stage_spec_json(spec: AnyRunSpec) -> dict[str, Any]:
    """A stage's spec as stored until its run is made: the spec's dump plus the run's tags and note (which a
    run's stored spec leaves out: they live on the run), so the stage's run gets them."""
    out: dict[str, Any] = spec.model_dump(mode="json")
    labels = {"tags": spec.tags, "note": spec.note}
    return out | {k: v for k, v in labels.items() if v is not None}


def _stage_refs(spec_json: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """(path, referenced stage name) for every ``stage:<name>`` model reference of a stage spec: the
    policy, the reference model, the critic, reward and eval-reward models alike."""
    refs = []
    for ref in spec_references(parse_spec(spec_json)):
        name = parse_stage_ref(ref.value) if ref.kind == "model" else None
        if name is not None:
            refs.append((ref.path, name))
    return refs


def create_pipeline(
    *,
    session: Session,
    body: PipelineCreate,
    roots: Sequence[Path],
    allow_hub: bool = False,
    project_id: uuid.UUID = DEFAULT_PROJECT_ID,
    worker_devices: int | None = None,
    worker_hosts: int | None = None,
    engine_python: str | None = None,
    engine_url: str | None = None,
) -> Pipeline:
    """Check every stage now (names, references, datasets), store the pipeline, start what can start.
    A stage's ``stage:`` references name earlier stages, so the stages' order is a valid start order."""
    seen: dict[str, str] = {}  # stage name -> algorithm, of the stages before this one
    for i, stage in enumerate(body.stages):
        where = f"stages[{i}]"
        if stage.name in seen:
            raise InvalidRequest(f"{where}.name: stage '{stage.name}' appears twice", field=f"{where}.name")
        check_references(
            session=session,
            spec=stage.spec,
            project_id=project_id,
            roots=roots,
            allow_hub=allow_hub,
            stages=seen,
            prefix=f"{where}.spec.",
        )
        check_learnable(stage.spec, prefix=f"{where}.spec.")
        check_devices(stage.spec, worker_devices, prefix=f"{where}.spec.", worker_hosts=worker_hosts)
        check_engine(stage.spec, engine_python, prefix=f"{where}.spec.", engine_url=engine_url)
        seen[stage.name] = stage.spec.algorithm
    pipeline = Pipeline(
        id=uuid.uuid4(),
        project_id=project_id,
        name=body.name,
        status="running",
        # a stored environment's code is kept now, as a run keeps it: deleting it later changes no stage
        stages=[
            {"name": s.name, "spec": stage_spec_json(with_environment_source(session, s.spec, project_id))}
            for s in body.stages
        ],
        created_at=utcnow(),
    )
    session.add(pipeline)
    session.flush()
    return pipeline


def stage_runs(session: Session, pipeline_id: uuid.UUID) -> dict[str, Run]:
    runs = session.scalars(select(Run).where(Run.pipeline_id == pipeline_id))
    return {r.stage: r for r in runs if r.stage is not None}


def pipeline_read(session: Session, pipeline: Pipeline) -> PipelineRead:
    """The API's pipeline object: each stage with its run and status (``waiting`` before it has one)."""
    runs = stage_runs(session, pipeline.id)
    stages = []
    for stage in pipeline.stages:
        run = runs.get(stage["name"])
        stages.append(
            StageRead(
                name=stage["name"],
                algorithm=stage["spec"]["algorithm"],
                run_id=run.id if run else None,
                status=run.status if run else "waiting",
            )
        )
    return PipelineRead(
        id=pipeline.id,
        name=pipeline.name,
        status=pipeline.status,
        reason=pipeline.reason,
        stages=stages,
        created_at=pipeline.created_at,
        finished_at=pipeline.finished_at,
    )


def _finish(pipeline: Pipeline, status: str, reason: str | None) -> None:
    pipeline.status, pipeline.reason, pipeline.finished_at = status, reason, utcnow()
    log.info("pipeline %s %s%s", pipeline.id, status, f": {reason}" if reason else "")


def advance(*, session: Session, pipeline_id: uuid.UUID) -> list[uuid.UUID]:
    """Create the stage runs whose inputs succeeded; end the rest if a stage failed. Returns new run ids
    (queued; the caller enqueues them after commit)."""
    pipeline = session.get(Pipeline, pipeline_id, with_for_update=True)
    if pipeline is None or pipeline.status != "running":
        return []
    runs = stage_runs(session, pipeline_id)
    broken = next((r for r in runs.values() if r.status in ("failed", "cancelled")), None)
    if broken is not None:
        reason = f"stage '{broken.stage}' {broken.status}"
        for stage in pipeline.stages:
            run = runs.get(stage["name"])
            if run is None:
                run = _cancelled_stage_run(session, pipeline, stage, reason)
            elif run.status not in FINISHED_STATUSES:
                cancel_run(session=session, run=run)
                add_event(session, run.id, "info", f"pipeline cancelled: {reason}")
        _finish(pipeline, "failed" if broken.status == "failed" else "cancelled", reason)
        session.flush()
        return []
    created = []
    for stage in pipeline.stages:
        if stage["name"] in runs:
            continue
        refs = _stage_refs(stage["spec"])
        inputs = [runs.get(name) for _, name in refs]
        if any(r is None or r.status != "succeeded" for r in inputs):
            continue
        spec_json = copy.deepcopy(stage["spec"])
        for path, name in refs:
            set_at(spec_json, path, f"run:{runs[name].id}")
        run = submit_run(
            session=session,
            spec=parse_spec(spec_json),
            pipeline_id=pipeline.id,
            stage=stage["name"],
            project_id=pipeline.project_id,
        )
        runs[stage["name"]] = run
        created.append(run.id)
    if len(runs) == len(pipeline.stages) and all(r.status == "succeeded" for r in runs.values()):
        _finish(pipeline, "succeeded", None)
    session.flush()
    return created


def _cancelled_stage_run(session: Session, pipeline: Pipeline, stage: dict[str, Any], reason: str) -> Run:
    """A stage that never started still gets a run row, ended ``cancelled`` with the reason."""
    spec = TypeAdapter(RunSpec).validate_python(stage["spec"])
    run = Run(
        id=uuid.uuid4(),
        project_id=pipeline.project_id,
        algorithm=spec.algorithm,
        spec=stage["spec"],
        dataset_id=getattr(spec, "dataset_id", None),  # a merge has none
        attempt=0,
        step=0,
        total_steps=total_steps(session, spec),
        created_at=utcnow(),
        pipeline_id=pipeline.id,
        stage=stage["name"],
    )
    return add_cancelled_run(session, run, f"pipeline: {reason}")


def cancel_pipeline(*, session: Session, pipeline: Pipeline) -> Pipeline:
    """Cancel the running stage and every stage not yet started."""
    if pipeline.status != "running":
        raise InvalidTransition(f"pipeline {pipeline.id} already ended {pipeline.status}", field="status")
    runs = stage_runs(session, pipeline.id)
    for stage in pipeline.stages:
        run = runs.get(stage["name"])
        if run is None:
            _cancelled_stage_run(session, pipeline, stage, "pipeline cancelled by the user")
        elif run.status not in FINISHED_STATUSES:
            cancel_run(session=session, run=run)
    _finish(pipeline, "cancelled", "cancelled by the user")
    session.flush()
    return pipeline


def cancel_run_and_its_pipeline(*, session: Session, run: Run) -> Run:
    """Cancel a run (api/lifecycle.py); one that ended cancelled at once takes the rest of its pipeline
    with it (a running one does when its worker stops)."""
    run = cancel_run(session=session, run=run)
    if run.pipeline_id is not None and run.status == "cancelled":
        advance(session=session, pipeline_id=run.pipeline_id)
    return run


def get_pipeline(
    *, session: Session, pipeline_id: uuid.UUID, project_id: uuid.UUID = DEFAULT_PROJECT_ID
) -> Pipeline:
    pipeline = session.get(Pipeline, pipeline_id)
    if pipeline is None or pipeline.project_id != project_id:
        raise PipelineNotFound(f"pipeline {pipeline_id} does not exist", field="pipeline_id")
    return pipeline
