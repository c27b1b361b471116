"""One resolver for every reference a run spec carries (models, datasets), checked against the caller's
project before anything is stored. Never commits.

``trainer.specs.spec_references`` finds the reference fields by the mark in their schema, so a new field
cannot skip these checks. A reference to another project's run or dataset gets exactly the answer of an
unknown id for that field (404 for datasets, 409 for model references): ids of other projects cannot
be probed.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from pathlib import Path

from sqlalchemy.orm import Session

from api.errors import DatasetNotFound, IncompatibleDataset, InvalidReference, InvalidRequest
from api.models import Checkpoint, Dataset, Run
from trainer.model_refs import ModelOutsideRoots, UnknownModel, check_loadable
from trainer.specs import (
    AnyRunSpec,
    Reference,
    parse_run_ref,
    parse_run_ref_step,
    parse_stage_ref,
    spec_references,
)


def _dataset(session: Session, ref: Reference, field: str, project_id: uuid.UUID | None) -> Dataset:
    dataset_id = uuid.UUID(ref.value)
    dataset = session.get(Dataset, dataset_id)
    if dataset is None or (project_id is not None and dataset.project_id != project_id):
        raise DatasetNotFound(f"{field}: dataset {dataset_id} does not exist", field=field)
    return dataset


def _run_model(session: Session, ref: str, field: str, project_id: uuid.UUID | None) -> None:
    """``run:<id>`` must name a succeeded run of the project; ``run:<id>@<step>`` one of its checkpoints."""
    run_id = parse_run_ref(ref)
    assert run_id is not None
    source = session.get(Run, run_id)
    if source is None or (project_id is not None and source.project_id != project_id):
        raise InvalidReference(f"{field}: run {run_id} does not exist", field=field)
    step = parse_run_ref_step(ref)
    if step is not None:
        if session.get(Checkpoint, (run_id, step)) is None:
            raise InvalidReference(f"{field}: run {run_id} has no checkpoint at step {step}", field=field)
    elif source.status != "succeeded" or not source.output_path:
        raise InvalidReference(
            f"{field}: run {run_id} is {source.status}; only a succeeded run's model can be used", field=field
        )


def check_model_reference(
    session: Session,
    ref: str,
    field: str,
    *,
    project_id: uuid.UUID | None,
    roots: Sequence[Path] | None,
    allow_hub: bool,
    stages: Collection[str] | None = None,
) -> None:
    """One model reference. ``stages``: the stage names it may refer to (None: not in a pipeline);
    ``roots=None``: plain names were checked earlier (a pipeline stage created from a checked spec)."""
    stage = parse_stage_ref(ref)
    if stage is not None:
        if stages is None:
            raise InvalidReference(f"{field}: stage references are valid only inside a pipeline", field=field)
        if stage not in stages:
            raise InvalidRequest(f"{field}: 'stage:{stage}' must name an earlier stage", field=field)
        return
    if parse_run_ref(ref) is not None:
        _run_model(session, ref, field, project_id)
        return
    if roots is None:
        return
    try:
        check_loadable(ref, roots, allow_hub=allow_hub)
    except ModelOutsideRoots as exc:
        raise InvalidReference(f"{field}: {exc}", field=field) from None
    except UnknownModel as exc:
        raise InvalidRequest(f"{field}: {exc}", field=field) from None


def check_references(
    *,
    session: Session,
    spec: AnyRunSpec,
    project_id: uuid.UUID | None,
    roots: Sequence[Path] | None,
    allow_hub: bool = False,
    stages: Collection[str] | None = None,
    prefix: str = "",
) -> None:
    """Every reference in ``spec``: datasets exist in the project and fit the run type (a validation set
    of the training set's kind), model references resolve. ``prefix`` goes before each field name in
    errors (``stages[1].spec.``)."""
    kinds: dict[str, str] = {}
    for ref in spec_references(spec):
        field = prefix + ref.field
        if ref.kind == "dataset":
            dataset = _dataset(session, ref, field, project_id)
            if dataset.kind not in spec.dataset_kinds:
                wanted = " or ".join(f"'{k}'" for k in spec.dataset_kinds)
                raise IncompatibleDataset(
                    f"dataset {dataset.id} is of kind '{dataset.kind}'; {spec.algorithm} needs {wanted}",
                    field=field,
                )
            kinds[ref.field] = dataset.kind
        else:
            check_model_reference(
                session,
                ref.value,
                field,
                project_id=project_id,
                roots=roots,
                allow_hub=allow_hub,
                stages=stages,
            )
    train, val = kinds.get("dataset_id"), kinds.get("validation_dataset_id")
    if val is not None and val != train:
        raise IncompatibleDataset(
            f"validation dataset is of kind '{val}' but the training dataset is '{train}'",
            field=prefix + "validation_dataset_id",
        )
