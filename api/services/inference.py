"""Which model a chat or completion request names, and where its files are (torch-free; never commits).

Accepted names, each scoped to the caller's project (another project's run answers exactly like an
unknown one): ``run:<id>`` (a succeeded run's final model; the jobs surface's ``fine_tuned_model``),
``ft:<anything>:<id>`` (OpenAI's form: the last part is the run or job id), ``run:<id>@<step>`` (a
checkpoint), ``tiny:<preset>`` and model folders under the server's model roots. Reward-model runs and
sequence-classification folders are refused: they score text, they cannot generate it. An archived run's
model is gone under every name it had.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from api.errors import ModelNotDeletable, ModelNotFound, ModelNotGenerative
from api.models import Checkpoint, Run, utcnow
from api.services.references import SCORER_ALGORITHMS, is_sequence_classifier
from api.settings import Settings
from trainer.model_refs import ModelOutsideRoots, UnknownModel, find_in_roots, is_local_path
from trainer.specs import MODELLESS_ALGORITHMS, TINY_PRESETS, parse_run_ref, parse_run_ref_step

_FT_NAME = re.compile(r"^ft:.+:(?:ftjob-)?(?P<id>[0-9a-fA-F-]{32,36})$")


@dataclass(frozen=True)
class ServedModel:
    name: str  # as the caller wrote it (answers echo it)
    source: str  # a folder, or tiny:<preset>: what the inference process loads


def run_of_name(name: str) -> tuple[uuid.UUID, int | None] | None:
    """(run id, checkpoint step or None) for ``run:`` and ``ft:`` names; None for other names."""
    run_id = parse_run_ref(name)
    if run_id is not None:
        return run_id, parse_run_ref_step(name)
    match = _FT_NAME.match(name)
    if match:
        try:
            return uuid.UUID(match["id"]), None
        except ValueError:
            return None
    return None


def _not_found(name: str) -> ModelNotFound:
    return ModelNotFound(f"The model `{name}` does not exist or you do not have access to it.", field="model")


@dataclass(frozen=True)
class NamedModel:
    """What a model name stands for, for ``GET /v1/models/{model}`` (reward models included)."""

    name: str
    source: str  # preset, folder, run, checkpoint
    run: Run | None = None
    checkpoint: Checkpoint | None = None
    folder: Path | None = None  # for a folder under the model roots: where it is


def find_model(session: Session, project_id: uuid.UUID, name: str, settings: Settings) -> NamedModel:
    """Any model the project may name, or ModelNotFound (404)."""
    ref = run_of_name(name)
    if ref is not None:
        run_id, step = ref
        run = session.get(Run, run_id)
        if run is None or run.project_id != project_id or run.model_archived_at is not None:
            raise _not_found(name)  # an archived model answers like a deleted one, as OpenAI's do
        if run.algorithm in MODELLESS_ALGORITHMS:
            raise ModelNotFound(
                f"run {run_id} is an {run.algorithm} run: it trains nothing and makes no model", field="model"
            )
        if step is not None:
            checkpoint = session.get(Checkpoint, (run_id, step))
            if checkpoint is None:
                raise ModelNotFound(f"run {run_id} has no checkpoint at step {step}", field="model")
            return NamedModel(name, "checkpoint", run, checkpoint)
        if run.status != "succeeded" or not run.output_path:
            raise ModelNotFound(
                f"run {run_id} is {run.status}: only a succeeded run is a model (or one of its checkpoints, "
                "`run:<id>@<step>`)",
                field="model",
            )
        return NamedModel(name, "run", run)
    if name.startswith("tiny:") and name.removeprefix("tiny:") in TINY_PRESETS:
        return NamedModel(name, "preset")
    if not is_local_path(name):
        try:
            folder = find_in_roots(name, settings.resolved_model_roots)
        except (UnknownModel, ModelOutsideRoots):
            folder = None
        if folder is not None:
            return NamedModel(name, "folder", folder=folder)
    raise _not_found(name)


def archive_model(session: Session, project_id: uuid.UUID, name: str, settings: Settings) -> Run:
    """Archive a run's model (OpenAI's model delete): hidden from lists, refused by chat and by specs; the
    files, the run and its checkpoints stay. Presets and folders are not the project's to delete (403)."""
    found = find_model(session, project_id, name, settings)
    if found.run is None or found.checkpoint is not None:
        raise ModelNotDeletable(
            f"`{name}` is not a run's final model: only `run:<id>` (or its `ft:` name) can be archived",
            field="model",
        )
    found.run.model_archived_at = utcnow()
    return found.run


def resolve_served_model(
    session: Session, project_id: uuid.UUID, name: str, settings: Settings
) -> ServedModel:
    """The files to serve for ``name``, or ModelNotFound (404) / ModelNotGenerative (400)."""
    found = find_model(session, project_id, name, settings)
    if found.run is not None and found.run.algorithm in SCORER_ALGORITHMS:
        raise ModelNotGenerative(
            f"`{name}` is a reward model (run {found.run.id}, algorithm {found.run.algorithm}): it scores "
            "text and cannot generate it; chat with a policy (an sft, dpo or RL run)",
            field="model",
        )
    if found.checkpoint is not None:
        return ServedModel(name, found.checkpoint.path)
    if found.run is not None:
        assert found.run.output_path is not None  # find_model checked
        return ServedModel(name, found.run.output_path)
    if found.source == "preset":
        return ServedModel(name, name)
    folder = found.folder
    assert folder is not None  # the one source left: a folder under the roots, found above
    if is_sequence_classifier(folder):
        raise ModelNotGenerative(
            f"`{name}` is a sequence-classification model: it cannot generate", field="model"
        )
    return ServedModel(name, str(folder))
