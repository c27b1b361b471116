"""One resolver for every reference a run spec carries (models, datasets, environments), checked against
the caller's project before anything is stored. Never commits.

``trainer.specs.spec_references`` finds the reference fields by the mark in their schema, so a new field
cannot skip these checks. A reference to another project's run or dataset gets exactly the answer of an
unknown id for that field (404 for datasets, 409 for model references): ids of other projects cannot
be probed. A model is also checked for the role its field gives it (policy, reward, critic).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from sqlalchemy.orm import Session

from api.errors import DatasetNotFound, IncompatibleDataset, InvalidReference, InvalidRequest
from api.models import Checkpoint, Dataset, Run
from api.services.environments import with_environment_source
from trainer.adapter_folders import ADAPTER_CONFIG, is_adapter_folder
from trainer.lr_defaults import approx_params, default_learning_rate, preset_params_of
from trainer.model_refs import ModelOutsideRoots, UnknownModel, is_local_path, resolve_name
from trainer.specs import (
    MODELLESS_ALGORITHMS,
    TINY_PRESETS,
    AnyRunSpec,
    EvalSpec,
    MergeSpec,
    ModelRole,
    Reference,
    TrainingHyperparameters,
    learning_problems,
    parse_run_ref,
    parse_run_ref_step,
    parse_stage_ref,
    spec_references,
)

SCORER_ALGORITHMS = frozenset({"reward_model"})  # runs whose model is a scorer (a score head, no LM head)


def _dataset(session: Session, ref: Reference, field: str, project_id: uuid.UUID | None) -> Dataset:
    dataset_id = uuid.UUID(ref.value)
    dataset = session.get(Dataset, dataset_id)
    if dataset is None or (project_id is not None and dataset.project_id != project_id):
        raise DatasetNotFound(f"{field}: dataset {dataset_id} does not exist", field=field)
    return dataset


def _run_model(session: Session, ref: str, field: str, project_id: uuid.UUID | None) -> Run:
    """``run:<id>`` must name a succeeded run of the project; ``run:<id>@<step>`` one of its checkpoints."""
    run_id = parse_run_ref(ref)
    assert run_id is not None
    source = session.get(Run, run_id)
    if source is None or (project_id is not None and source.project_id != project_id):
        raise InvalidReference(f"{field}: run {run_id} does not exist", field=field)
    if source.algorithm in MODELLESS_ALGORITHMS:
        raise InvalidReference(
            f"{field}: run {run_id} is an {source.algorithm} run: it trains nothing and makes no model",
            field=field,
        )
    if source.model_archived_at is not None:
        raise InvalidReference(f"{field}: run {run_id}'s model is archived", field=field)
    step = parse_run_ref_step(ref)
    if step is not None:
        if session.get(Checkpoint, (run_id, step)) is None:
            raise InvalidReference(f"{field}: run {run_id} has no checkpoint at step {step}", field=field)
    elif source.status != "succeeded" or not source.output_path:
        raise InvalidReference(
            f"{field}: run {run_id} is {source.status}; only a succeeded run's model can be used", field=field
        )
    return source


def is_sequence_classifier(folder: Path) -> bool | None:
    """Whether a model folder's config names a ``...ForSequenceClassification`` architecture (None: no
    readable config says)."""
    try:
        architectures = json.loads((folder / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(architectures, list) or not architectures:
        return None
    return any(str(a).endswith("ForSequenceClassification") for a in architectures)


def _check_role(role: ModelRole | None, field: str, what: str, *, scorer: bool | None) -> None:
    """A scorer (a reward model: a score head, no LM head) cannot be a policy; a reward needs a scorer.
    ``scorer=None``: unknown (a hub id), allowed."""
    if role == "policy" and scorer is True:
        raise InvalidRequest(
            f"{field}: {what} is a reward model (a score head, no LM head) and cannot generate: a policy or "
            "reference model must be a causal LM (a preset, an sft, dpo or RL run, or a causal-LM folder)",
            field=field,
        )
    if role == "reward" and scorer is False:
        raise InvalidRequest(
            f"{field}: {what} is a causal LM, whose score head would be random: a reward_model reward needs "
            "a reward-model run (algorithm reward_model) or a sequence-classification model folder",
            field=field,
        )


def check_model_reference(
    session: Session,
    ref: str,
    field: str,
    *,
    project_id: uuid.UUID | None,
    roots: Sequence[Path] | None,
    allow_hub: bool,
    role: ModelRole | None = None,
    stages: Mapping[str, str] | None = None,
) -> None:
    """One model reference, and whether it can serve as ``role``. ``stages``: stage name -> algorithm of
    the stages it may refer to (None: not in a pipeline); ``roots=None``: plain names were checked earlier
    (a pipeline stage created from a checked spec)."""
    stage = parse_stage_ref(ref)
    if stage is not None:
        if stages is None:
            raise InvalidReference(f"{field}: stage references are valid only inside a pipeline", field=field)
        if stage not in stages:
            raise InvalidRequest(f"{field}: 'stage:{stage}' must name an earlier stage", field=field)
        if stages[stage] in MODELLESS_ALGORITHMS:
            raise InvalidRequest(
                f"{field}: stage '{stage}' is an {stages[stage]} run, which makes no model", field=field
            )
        scorer = stages[stage] in SCORER_ALGORITHMS
        _check_role(role, field, f"stage '{stage}' ({stages[stage]})", scorer=scorer)
        return
    if parse_run_ref(ref) is not None:
        source = _run_model(session, ref, field, project_id)
        scorer = source.algorithm in SCORER_ALGORITHMS
        _check_role(role, field, f"run {source.id} ({source.algorithm})", scorer=scorer)
        return
    if ref.startswith("tiny:"):
        _check_role(role, field, f"preset {ref}", scorer=False)
        return
    if roots is None:
        return
    try:
        target = resolve_name(ref, roots, allow_hub=allow_hub, presets=TINY_PRESETS)
    except ModelOutsideRoots as exc:
        raise InvalidReference(f"{field}: {exc}", field=field) from None
    except UnknownModel as exc:
        raise InvalidRequest(f"{field}: {exc}", field=field) from None
    if target != ref or is_local_path(ref):  # a folder here, not a hub id
        _check_role(role, field, f"model {ref!r}", scorer=is_sequence_classifier(Path(target)))


def check_learnable(spec: AnyRunSpec, prefix: str = "") -> None:
    """422 naming the first setting with which the run could not learn (``learning_problems``)."""
    for field, why in learning_problems(spec):
        raise InvalidRequest(f"{prefix}{field}: {why}", field=prefix + field)


def check_devices(
    spec: AnyRunSpec, worker_devices: int | None, prefix: str = "", worker_hosts: int | None = None
) -> None:
    """422 when the run asks for more devices than the operator says any worker has (``worker_devices``),
    or for more hosts than the deployment has workers to gather (``worker_hosts``)."""
    if worker_devices is not None and spec.resources.devices > worker_devices:
        field = f"{prefix}resources.devices"
        raise InvalidRequest(
            f"{field}: {spec.resources.devices} devices asked, but no worker of this deployment has more "
            f"than {worker_devices} (RLRUN_WORKER_DEVICES)",
            field=field,
        )
    if worker_hosts is not None and spec.resources.nodes > worker_hosts:
        field = f"{prefix}resources.nodes"
        raise InvalidRequest(
            f"{field}: {spec.resources.nodes} hosts asked, but this deployment has {worker_hosts} worker "
            "host(s) to gather (RLRUN_WORKER_HOSTS): the run could never start",
            field=field,
        )


def check_engine(
    spec: AnyRunSpec, engine_python_setting: str | None, prefix: str = "", engine_url: str | None = None
) -> None:
    """422 when the run asks for the engine process (``engine: vllm_server``) and no engine environment
    is configured or installed here, naming the setting and the install command; never where a running
    engine is configured (``engine_url``: the workers use it)."""
    from trainer.rollout.engine_process import EngineUnavailable, engine_python

    hp = getattr(spec, "hyperparameters", None)
    if getattr(hp, "engine", "hf") != "vllm_server" or engine_url:
        return
    try:
        engine_python(engine_python_setting)
    except EngineUnavailable as exc:
        field = f"{prefix}hyperparameters.engine"
        raise InvalidRequest(f"{field}: {exc}", field=field) from None


def check_references(
    *,
    session: Session,
    spec: AnyRunSpec,
    project_id: uuid.UUID | None,
    roots: Sequence[Path] | None,
    allow_hub: bool = False,
    stages: Mapping[str, str] | None = None,
    prefix: str = "",
) -> None:
    """Every reference in ``spec``: datasets exist in the project and fit the run type (a validation set
    of the training set's kind), model references resolve. ``prefix`` goes before each field name in
    errors (``stages[1].spec.``)."""
    kinds: dict[str, str] = {}
    for ref in spec_references(spec):
        field = prefix + ref.field
        if ref.kind == "environment":
            with_environment_source(session, spec, project_id, prefix)  # exists in the project
            continue
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
                # A reward-model run may start from a reward model: it loads a scorer either way.
                role=None if spec.algorithm == "reward_model" else ref.role,
                stages=stages,
            )
    if isinstance(spec, MergeSpec):
        check_mergeable(session, spec.model, prefix + "model", roots)
    train, val = kinds.get("dataset_id"), kinds.get("validation_dataset_id")
    if val is not None and val != train:
        raise IncompatibleDataset(
            f"validation dataset is of kind '{val}' but the training dataset is '{train}'",
            field=prefix + "validation_dataset_id",
        )


def check_mergeable(session: Session, ref: str, field: str, roots: Sequence[Path] | None) -> None:
    """A merge's model must be an adapter: a run (or checkpoint) trained with one, or an adapter folder.
    A stage is checked when its run ends (the merge fails saying why); a hub id cannot be checked here."""
    run_id = parse_run_ref(ref)
    if run_id is not None:
        source = session.get(Run, run_id)
        if source is not None and not source.spec.get("adapter"):
            raise InvalidRequest(
                f"{field}: run {run_id} ({source.algorithm}) trained the whole model, not an adapter: "
                f"nothing to merge; GET /v1/runs/{run_id}/export?format=hf streams it as it is",
                field=field,
            )
        return
    if ref.startswith("tiny:"):
        raise InvalidRequest(f"{field}: preset {ref} is a whole model, not an adapter", field=field)
    if roots is None or parse_stage_ref(ref) is not None:
        return
    try:
        folder = resolve_name(ref, roots, allow_hub=False)
    except (ModelOutsideRoots, UnknownModel):
        return  # check_model_reference has answered for it
    if not is_adapter_folder(folder):
        raise InvalidRequest(f"{field}: {ref!r} is not an adapter folder (no {ADAPTER_CONFIG})", field=field)


def model_params(session: Session, ref: str, roots: Sequence[Path], depth: int = 0) -> int | None:
    """Approximate parameter count of a model reference: a preset's from its dimensions, a folder's from
    its ``config.json``, a run's from the model it started from (followed back to a preset or folder).
    None when unknown (a hub id, a config without sizes)."""
    if ref.startswith("tiny:"):
        return preset_params_of(ref)
    run_id = parse_run_ref(ref)
    if run_id is not None:
        source = session.get(Run, run_id)
        start = source.spec.get("model") if source is not None else None
        if not isinstance(start, str) or depth >= 16:
            return None
        return model_params(session, start, roots, depth + 1)
    try:  # a folder inside the roots only: a hub id's size is unknown here, the working directory never read
        folder = Path(resolve_name(ref, roots, allow_hub=False))
        config = json.loads((folder / "config.json").read_text())
    except (ValueError, OSError):
        return None
    return approx_params(config) if isinstance(config, dict) else None


def with_default_learning_rate(session: Session, spec: AnyRunSpec, roots: Sequence[Path]) -> AnyRunSpec:
    """``spec`` with a missing learning rate picked by family, model size and adapter
    (trainer/lr_defaults.py); a run that trains nothing (eval, merge: no learning rate) as it is."""
    hp = spec.hyperparameters
    if not isinstance(hp, TrainingHyperparameters) or hp.learning_rate is not None:
        return spec
    lora = getattr(spec, "adapter", None) is not None
    rate = default_learning_rate(spec.algorithm, model_params(session, spec.model, roots), lora=lora)
    return spec.model_copy(update={"hyperparameters": hp.model_copy(update={"learning_rate": rate})})


def total_steps(session: Session, spec: AnyRunSpec) -> int | None:
    """The steps a run will take: from its spec, or for an eval (one step per prompt) from its dataset's
    rows."""
    if isinstance(spec, EvalSpec):
        dataset = session.get(Dataset, spec.dataset_id)
        return None if dataset is None else spec.total_steps_for(dataset.row_count)
    return spec.total_steps
