"""/v1/runs/{id}/checkpoints: list a run's checkpoints and download one as a tar archive."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path as FsPath
from typing import Annotated, Any

from fastapi import APIRouter, Path
from fastapi.responses import StreamingResponse

from api.deps import RunDep, SessionDep
from api.errors import NotFound
from api.models import Checkpoint
from api.services import checkpoints as service
from rlrun.schemas import CheckpointRead, ErrorBody
from trainer.specs import MAX_STEP

router = APIRouter(prefix="/v1/runs/{run_id}/checkpoints", tags=["checkpoints"])
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (404, 422)}
CHUNK = 1 << 20


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


def tar_stream(folder: FsPath, arcname: str) -> Iterator[bytes]:
    """An uncompressed tar of ``folder``, produced file by file in 1 MiB chunks (bounded memory;
    weights barely compress). Format: per file a 512-byte header, the data padded to 512, then two
    zero blocks (POSIX ustar, as ``tarfile`` writes it)."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        info = tarfile.TarInfo(f"{arcname}/{path.relative_to(folder).as_posix()}")
        info.size, info.mtime, info.mode = path.stat().st_size, int(path.stat().st_mtime), 0o644
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        with path.open("rb") as fh:
            while chunk := fh.read(CHUNK):
                yield chunk
        if info.size % 512:
            yield b"\0" * (512 - info.size % 512)
    yield b"\0" * 1024


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
    return StreamingResponse(
        tar_stream(folder, name),
        media_type="application/x-tar",
        headers={"Content-Disposition": f'attachment; filename="{name}.tar"'},
    )
