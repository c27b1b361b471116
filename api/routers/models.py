"""GET /v1/models and /v1/models/{model}: the models this project may name in a run spec or a chat request
(OpenAI's shapes, with rlrun's fields; errors in OpenAI's shape)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, Field

from api.deps import ProjectDep, SessionDep, SettingsDep
from api.errors import OpenAIErrorBody
from api.models import Run
from api.services.checkpoints import checkpoints_of_runs
from api.services.inference import archive_model, find_model
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
    source: Literal["preset", "folder", "run", "checkpoint"]
    algorithm: str | None = Field(default=None, description="For runs: the run type that made the model.")
    chat: bool = Field(
        default=True,
        description="Whether `/v1/chat/completions` and `/v1/completions` serve it (reward models score, "
        "they do not generate).",
    )
    parameters: int | None = Field(default=None, description="Approximate size, where known.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelRead]


_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": OpenAIErrorBody} for code in (401, 404)}


def _run_model(run: Run, step: int | None = None, created: int | None = None) -> ModelRead:
    finished = int(run.finished_at.timestamp()) if run.finished_at else 0
    return ModelRead(
        id=f"run:{run.id}" + (f"@{step}" if step is not None else ""),
        created=created if created is not None else finished,
        owned_by=str(run.project_id),
        source="run" if step is None else "checkpoint",
        algorithm=run.algorithm,
        chat=run.algorithm != "reward_model",
    )


@router.get("", response_model=ModelList, responses=_ERRORS)
def list_models(
    session: SessionDep,
    settings: SettingsDep,
    project_id: ProjectDep,
    runs: Annotated[int, Query(ge=0, le=1000, description="At most this many runs, newest first.")] = 100,
) -> ModelList:
    """Presets, model folders under the server's model roots, this project's succeeded runs (newest first)
    and their checkpoints (`run:<id>@<step>`)."""
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
    data += [_run_model(run) for run in finished]
    by_id = {run.id: run for run in finished}
    data += [
        _run_model(by_id[c.run_id], c.step, int(c.created_at.timestamp()))
        for c in checkpoints_of_runs(session=session, run_ids=list(by_id))
    ]
    return ModelList(data=data)


@router.get("/{model:path}", response_model=ModelRead, responses=_ERRORS)
def retrieve_model(
    model: Annotated[str, Path(description="A name `GET /v1/models` lists (`run:<id>`, `ft:...:<id>` too).")],
    session: SessionDep,
    settings: SettingsDep,
    project_id: ProjectDep,
) -> ModelRead:
    """One model by name; another project's run answers 404 like an unknown one."""
    found = find_model(session, project_id, model, settings)
    if found.run is not None:
        step = found.checkpoint.step if found.checkpoint is not None else None
        return _run_model(found.run, step).model_copy(update={"id": model})  # ft:... names echo back
    if found.source == "preset":
        dims = TINY_PRESETS[model.removeprefix("tiny:")]
        return ModelRead(
            id=model, created=0, owned_by="rlrun", source="preset", parameters=preset_params(dims)
        )
    return ModelRead(id=model, created=0, owned_by="local", source="folder")


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool = Field(description="Always true: the model is archived (its files stay on the server).")


@router.delete(
    "/{model:path}", response_model=ModelDeleted, responses=_ERRORS | {403: {"model": OpenAIErrorBody}}
)
def delete_model(
    model: Annotated[str, Path(description="`run:<id>` or its `ft:` name.")],
    session: SessionDep,
    settings: SettingsDep,
    project_id: ProjectDep,
) -> ModelDeleted:
    """Archive a run's model (OpenAI's delete): it leaves `GET /v1/models`, answers 404 to retrieve, chat
    and completions under every name, and is refused as a spec's model; its files, checkpoints and the
    run itself stay. Presets and folders answer 403."""
    archive_model(session, project_id, model, settings)
    session.commit()
    return ModelDeleted(id=model, deleted=True)
