"""GET /v1/models: the models a run of this project may name (OpenAI's list shape, with rlrun's fields)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from api.deps import ProjectDep, SessionDep, SettingsDep
from api.services.runs import succeeded_runs
from trainer.lr_defaults import preset_params
from trainer.model_refs import models_in_roots
from trainer.specs import TINY_PRESETS

router = APIRouter(prefix="/v1/models", tags=["models"])


class ModelRead(BaseModel):
    id: str = Field(description="What to put in a spec's `model` field.")
    object: Literal["model"] = "model"
    created: int = Field(description="Unix seconds: when the run finished (0 for presets and folders).")
    owned_by: str = Field(description="`rlrun` for presets, `local` for folders, the project id for runs.")
    source: Literal["preset", "folder", "run"]
    algorithm: str | None = Field(default=None, description="For runs: the run type that made the model.")
    parameters: int | None = Field(default=None, description="Approximate size, where known.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelRead]


@router.get("", response_model=ModelList)
def list_models(
    session: SessionDep,
    settings: SettingsDep,
    project_id: ProjectDep,
    runs: Annotated[int, Query(ge=0, le=1000, description="At most this many runs, newest first.")] = 100,
) -> ModelList:
    """Presets, model folders under the server's model roots, and this project's succeeded runs."""
    data = [
        ModelRead(
            id=f"tiny:{name}", created=0, owned_by="rlrun", source="preset", parameters=preset_params(dims)
        )
        for name, dims in TINY_PRESETS.items()
    ]
    data += [
        ModelRead(id=name, created=0, owned_by="local", source="folder")
        for name in models_in_roots(settings.resolved_model_roots, limit=1000)
    ]
    finished = succeeded_runs(session=session, project_id=project_id, limit=runs)
    data += [
        ModelRead(
            id=f"run:{run.id}",
            created=int(run.finished_at.timestamp()) if run.finished_at else 0,
            owned_by=str(run.project_id),
            source="run",
            algorithm=run.algorithm,
        )
        for run in finished
    ]
    return ModelList(data=data)
