"""/v1/runs/{id}/checkpoints: list a run's checkpoints and download one as a tar archive."""

from __future__ import annotations

from pathlib import Path as FsPath
from typing import Annotated, Any

from fastapi import APIRouter, Path
from fastapi.responses import StreamingResponse

from api.deps import RunDep, SessionDep
from api.errors import NotFound
from api.models import Checkpoint
from api.services import checkpoints as service
from api.tar_stream import tar_response
from rlrun.schemas import CheckpointRead, ErrorBody
from trainer.specs import MAX_STEP

router = APIRouter(prefix="/v1/runs/{run_id}/checkpoints", tags=["checkpoints"])
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (404, 422)}


class CheckpointNotFound(NotFound):
    code = "checkpoint_not_found"


def to_read(ckpt: Checkpoint) -> CheckpointRead:
    return CheckpointRead(
        step=ckpt.step,
        size_bytes=ckpt.size_bytes,
        metrics=ckpt.metrics,
        created_at=ckpt.created_at,
        model_ref=f"run:{ckpt.run_id}@{ckpt.step}",
    )


@router.get("", response_model=list[CheckpointRead], responses=_ERRORS)
def list_checkpoints(run: RunDep, session: SessionDep) -> list[CheckpointRead]:
    """The run's kept checkpoints, oldest first (the last one of a succeeded run is its final model)."""
    return [to_read(c) for c in service.list_checkpoints(session=session, run_id=run.id)]


@router.get(
    "/{step}/download",
    responses={200: {"content": {"application/x-tar": {}}, "description": "tar archive"}, **_ERRORS},
    response_class=StreamingResponse,
)
def download_checkpoint(
    run: RunDep, session: SessionDep, step: Annotated[int, Path(ge=0, le=MAX_STEP)]
) -> StreamingResponse:
    """Stream one checkpoint folder (model, tokenizer, trainer state) as a tar archive."""
    ckpt = service.get_checkpoint(session=session, run_id=run.id, step=step)
    folder = FsPath(ckpt.path) if ckpt is not None else None
    if folder is None or not folder.is_dir():
        raise CheckpointNotFound(f"run {run.id} has no checkpoint at step {step}", field="step")
    name = f"{run.id}-step-{step}"
    return tar_response(folder, name)
