"""OpenAI's fine-tuning API mapped onto rlrun, the pure part: ids, kind detection, job request -> run
spec, and run/event/checkpoint/dataset -> OpenAI object. The DB side is ``api/services/openai_compat.py``.

A job's OpenAI method (with every ``auto`` resolved) is kept in the run's first event of kind
``fine_tuning_job``: the spec stores ``max_steps`` and ``learning_rate``, from which ``n_epochs`` cannot be
recovered exactly. Runs submitted through ``/v1/runs`` have no such event; their method is derived from
the spec and their ``n_epochs`` reads ``auto`` (they were budgeted in steps).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from api.errors import ApiError
from api.models import Checkpoint, Dataset, Event, Run
from api.openai_reinforcement import plan_reinforcement
from api.schemas_openai import (
    CheckpointMetrics,
    DpoMethod,
    DpoMethodHyperparameters,
    FileObject,
    FineTuningJob,
    FineTuningJobCreate,
    JobCheckpoint,
    JobError,
    JobEvent,
    JobHyperparameters,
    Method,
    ReinforcementMethod,
    ReinforcementMethodHyperparameters,
    SupervisedMethod,
    SupervisedMethodHyperparameters,
    hyperparameter_number,
)
from rlrun.formats import PREFERENCE_KEYS, LineError, is_rft_line, parse_json_line
from trainer.lr_defaults import default_learning_rate, preset_params_of
from trainer.specs import DpoHyperparameters as DpoSpecHyperparameters
from trainer.specs import DpoSpec, GroupRlSpec, SftSpec
from trainer.specs import SftHyperparameters as SftSpecHyperparameters
from trainer.specs.sinks import WandbSinkSpec

JOB_ALGORITHMS = ("sft", "dpo", "grpo")  # grpo: only runs made as reinforcement jobs (job_filter)
FILE_KINDS = ("sft", "preference", "prompts")
CREATED_EVENT = "fine_tuning_job"
AUTO_EPOCHS = 3  # OpenAI's long-standing starting point; `auto` here is a fixed rule, not a search
METHOD_KIND = {"supervised": "sft", "dpo": "preference", "reinforcement": "prompts"}
KIND_LINES = {
    "sft": "chat `messages` lines",
    "preference": "preference lines (`input`, `preferred_output`, `non_preferred_output`)",
    "prompts": "reinforcement lines (chat `messages` ending in a user turn, with the fields graders read)",
}
# Where rlrun's own field names show up in errors, the OpenAI request parameter they came from.
OPENAI_PARAMS = {
    "dataset_id": "training_file",
    "validation_dataset_id": "validation_file",
    "reference_model": "model",
    "name": "suffix",
}


# --- ids -----------------------------------------------------------------------------------------------


def _uuid_after(value: str, prefix: str) -> uuid.UUID | None:
    if not value.startswith(prefix):
        return None
    try:
        return uuid.UUID(hex=value[len(prefix) :])
    except ValueError:
        return None


def file_id(dataset_id: uuid.UUID) -> str:
    return f"file-{dataset_id.hex}"


def parse_file_id(value: str) -> uuid.UUID | None:
    return _uuid_after(value, "file-")


TRAINED_TOKENS = "tokens/trained"  # the loops' cumulative token count (trainer/loops/session.py)
RESULT_FILE_PREFIX = "file-results-"  # a job's metrics CSV: file-results-<run id hex>
RESULT_FILE_NAME = "step_metrics.csv"
# OpenAI's result-file columns, from rlrun's metrics (the first key a step has); every other key follows.
RESULT_COLUMNS: dict[str, tuple[str, ...]] = {
    "train_loss": ("loss",),
    "train_accuracy": ("token_accuracy", "rewards/accuracy"),
    "valid_loss": ("eval/loss",),
    "valid_mean_token_accuracy": ("eval/token_accuracy", "eval/rewards/accuracy"),
}


def result_file_id(run_id: uuid.UUID) -> str:
    return f"{RESULT_FILE_PREFIX}{run_id.hex}"


def parse_result_file_id(value: str) -> uuid.UUID | None:
    return _uuid_after(value, RESULT_FILE_PREFIX)


def job_id(run_id: uuid.UUID) -> str:
    return f"ftjob-{run_id.hex}"


def parse_job_id(value: str) -> uuid.UUID | None:
    return _uuid_after(value, "ftjob-")


def event_id(event: int) -> str:
    return f"ftevent-{event}"


def _count(text: str) -> int | None:
    """A non-negative integer a DB column can hold (ASCII digits only: ``"²".isdigit()`` is true)."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def parse_event_id(value: str) -> int | None:
    rest = value.removeprefix("ftevent-")
    return _count(rest) if rest != value else None


def checkpoint_id(run_id: uuid.UUID, step: int) -> str:
    return f"ftckpt-{run_id.hex}-{step}"


def parse_checkpoint_step(value: str) -> int | None:
    """The step of a ``ftckpt-<run hex>-<step>`` id (the run part is not checked: it is a cursor)."""
    rest = value.removeprefix("ftckpt-")
    return _count(rest.rpartition("-")[2]) if rest != value else None


def unix(moment: datetime) -> int:
    return int(moment.timestamp())


# --- files ---------------------------------------------------------------------------------------------


def detect_kind(first_line: bytes) -> str:
    """The dataset kind of an uploaded fine-tuning file, from its first non-blank line: OpenAI DPO lines
    (and rlrun's other preference formats, with ``chosen``/``rejected``) -> ``preference``, chat
    ``messages`` ending before the assistant's turn (reinforcement lines) -> ``prompts``, anything else
    -> ``sft``. Ingest then validates every line against that kind, so a mixed or malformed file is refused
    naming its first bad line. Not ``rlrun.formats.detect_upload_kind``: the Files API takes three kinds
    and reads any other line as ``sft`` (its error then names the line); the preference keys are shared."""
    try:
        obj = parse_json_line(first_line.strip())
    except LineError:
        return "sft"
    # `input` too: an OpenAI DPO line missing its outputs is refused as preference data, naming them
    if any(k in obj for k in ("input", *PREFERENCE_KEYS)):
        return "preference"
    return "prompts" if is_rft_line(obj) else "sft"


def result_file_object(run: Run, size: int) -> FileObject:
    """A job's result file: its metrics as CSV (``metrics_csv_lines``), ``size`` bytes."""
    finished = run.finished_at or run.created_at
    return FileObject(
        id=result_file_id(run.id),
        bytes=size,
        created_at=unix(finished),
        filename=RESULT_FILE_NAME,
        purpose="fine-tune-results",
    )


def _cell(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def metrics_csv_lines(keys: Sequence[str], rows: Iterable[tuple[int, str, float]]) -> Iterator[str]:
    """A run's metrics as OpenAI's result file, a line at a time: ``step`` and OpenAI's four columns
    (``RESULT_COLUMNS``, empty where the run has no such metric), then every rlrun metric of ``keys``
    (sorted). ``rows`` come ordered by step; only one step's values are held at a time."""
    yield ",".join(["step", *RESULT_COLUMNS, *keys]) + "\n"

    def line(step: int, values: dict[str, float]) -> str:
        mapped = [next((values[k] for k in ks if k in values), None) for ks in RESULT_COLUMNS.values()]
        return ",".join([str(step), *map(_cell, mapped), *(_cell(values.get(k)) for k in keys)]) + "\n"

    step: int | None = None
    values: dict[str, float] = {}
    for row_step, key, value in rows:
        if row_step != step:
            if step is not None:
                yield line(step, values)
            step, values = row_step, {}
        values[key] = value
    if step is not None:
        yield line(step, values)


def file_object(dataset: Dataset) -> FileObject:
    return FileObject(
        id=file_id(dataset.id),
        bytes=dataset.size_bytes,
        created_at=unix(dataset.created_at),
        filename=dataset.name,
    )


# --- job request -> run spec ---------------------------------------------------------------------------


def _requested(body: FineTuningJobCreate) -> tuple[str, SupervisedMethodHyperparameters, str]:
    """The method type, its hyperparameters as given, and the parameter path they came from."""
    method = body.method or Method(type="supervised")
    for other in ("supervised", "dpo", "reinforcement"):
        if other != method.type and getattr(method, other) is not None:
            raise ApiError(
                f"method.{other} is given but method.type is '{method.type}'", field=f"method.{other}"
            )
    if method.type == "reinforcement":
        if method.reinforcement is None:
            raise ApiError("method.reinforcement (with its grader) is required", field="method.reinforcement")
        if body.hyperparameters is not None:
            raise ApiError(
                "give hyperparameters under method.reinforcement.hyperparameters", field="hyperparameters"
            )
        return "reinforcement", SupervisedMethodHyperparameters(), "method.reinforcement.hyperparameters"
    config = method.supervised if method.type == "supervised" else method.dpo
    given = config.hyperparameters if config is not None else None
    if body.hyperparameters is not None:
        if method.type != "supervised" or given is not None:
            raise ApiError(
                f"give hyperparameters under method.{method.type}.hyperparameters (the top-level "
                "`hyperparameters` are the deprecated form for supervised jobs)",
                field="hyperparameters",
            )
        return "supervised", body.hyperparameters, "hyperparameters"
    default = DpoMethodHyperparameters() if method.type == "dpo" else SupervisedMethodHyperparameters()
    return method.type, given or default, f"method.{method.type}.hyperparameters"


def _check_kind(dataset: Dataset, method_type: str, param: str) -> None:
    needed = METHOD_KIND[method_type]
    if dataset.kind != needed:
        have = KIND_LINES.get(dataset.kind, f"'{dataset.kind}' data")
        raise ApiError(
            f"{param} {file_id(dataset.id)} holds {have}; method.type '{method_type}' needs "
            f"{KIND_LINES[needed]}",
            field=param,
        )


def _spec_param(loc: Sequence[int | str], hp_param: str) -> str:
    """The OpenAI parameter behind a spec validation error's location."""
    parts = [str(p) for p in loc]
    if parts[:1] != ["hyperparameters"]:
        return OPENAI_PARAMS.get(parts[0], ".".join(parts)) if parts else hp_param
    name = parts[1] if len(parts) > 1 else ""
    if name == "seed":
        return "seed"
    name = {"max_steps": "n_epochs", "learning_rate": "learning_rate_multiplier"}.get(name, name)
    return f"{hp_param}.{name}" if name else hp_param


def wandb_sinks(integrations: Sequence[dict[str, Any]] | None) -> list[WandbSinkSpec]:
    """OpenAI's ``integrations`` (``{"type": "wandb", "wandb": {project, name, entity, tags}}``, the one type
    OpenAI has) as the run's W&B metric sinks, online: the worker sends with its own WANDB_API_KEY."""
    sinks: list[WandbSinkSpec] = []
    for i, item in enumerate(integrations or []):
        if not isinstance(item, dict) or item.get("type") != "wandb":
            raise ApiError("the one integration type is 'wandb'", field=f"integrations[{i}].type")
        given = item.get("wandb")
        if not isinstance(given, dict):
            raise ApiError("give the W&B run as an object: {project, ...}", field=f"integrations[{i}].wandb")
        try:
            sinks.append(WandbSinkSpec.model_validate({**given, "type": "wandb", "mode": "online"}))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(f"{first['msg']}", field=f"integrations[{i}].wandb.{where}") from None
    return sinks


def integrations_of(spec: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A run's W&B sinks as OpenAI's ``integrations`` (None: it has none)."""
    found = [
        {"type": "wandb", "wandb": {k: v for k, v in s.items() if k in ("project", "name", "entity", "tags")}}
        for s in spec.get("metric_sinks") or []
        if s.get("type") == "wandb"
    ]
    return found or None


def plan_job(
    body: FineTuningJobCreate,
    *,
    training: Dataset,
    validation: Dataset | None,
    seed: int,
    n_params: int | None = None,
) -> tuple[SftSpec | DpoSpec | GroupRlSpec, Method]:
    """The run spec for an OpenAI job request and the job's method with every ``auto`` resolved.

    ``auto``: ``AUTO_EPOCHS`` epochs, the run type's default batch size capped at the file's rows,
    learning-rate multiplier 1 (the default learning rate of the run type for a model of ``n_params``
    parameters, trainer/lr_defaults.py; None: unknown size), DPO beta 0.1 (the spec default).
    ``max_steps = ceil(n_epochs * rows / batch_size)``. Raises ``ApiError`` naming the OpenAI parameter.
    """
    method_type, given, hp_param = _requested(body)
    sinks = wandb_sinks(body.integrations)
    _check_kind(training, method_type, "training_file")
    if validation is not None:
        _check_kind(validation, method_type, "validation_file")
    if method_type == "reinforcement":
        assert body.method is not None and body.method.reinforcement is not None
        rft, rft_method = plan_reinforcement(
            body,
            body.method.reinforcement,
            training=training,
            validation=validation,
            seed=seed,
            n_params=n_params if n_params is not None else preset_params_of(body.model),
        )
        return rft.model_copy(update={"metric_sinks": sinks or None}), rft_method
    spec_cls: type[SftSpec] | type[DpoSpec] = SftSpec if method_type == "supervised" else DpoSpec
    algorithm = "sft" if method_type == "supervised" else "dpo"
    defaults = (
        SftSpecHyperparameters if method_type == "supervised" else DpoSpecHyperparameters
    ).model_fields
    rows = training.row_count
    n_epochs = int(hyperparameter_number(given.n_epochs, AUTO_EPOCHS))
    batch_size = int(hyperparameter_number(given.batch_size, min(int(defaults["batch_size"].default), rows)))
    multiplier = hyperparameter_number(given.learning_rate_multiplier, 1.0)
    if n_params is None:
        n_params = preset_params_of(body.model)
    hp: dict[str, Any] = {
        "max_steps": -(-n_epochs * rows // batch_size),  # ceil, in integers
        "batch_size": batch_size,
        "learning_rate": multiplier * default_learning_rate(algorithm, n_params),
        "seed": seed,
    }
    resolved: dict[str, Any] = {
        "n_epochs": n_epochs,
        "batch_size": batch_size,
        "learning_rate_multiplier": multiplier,
    }
    if isinstance(given, DpoMethodHyperparameters):
        hp["beta"] = resolved["beta"] = hyperparameter_number(given.beta, float(defaults["beta"].default))
    try:
        spec = spec_cls.model_validate(
            {
                "algorithm": algorithm,
                "model": body.model,
                "dataset_id": training.id,
                "validation_dataset_id": validation.id if validation is not None else None,
                "name": body.suffix,
                "hyperparameters": hp,
                "metric_sinks": sinks or None,
            }
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _spec_param(first["loc"], hp_param)
        derived = {  # what the OpenAI parameter turned into, when that is what the spec refused
            "max_steps": f"{n_epochs} epoch(s) of {rows} rows at batch size {batch_size} are "
            f"{hp['max_steps']} steps; ",
            "learning_rate": f"{multiplier} x the default learning rate is {hp['learning_rate']:g}; ",
        }.get(str(first["loc"][-1]) if first["loc"] else "", "")
        raise ApiError(f"{param}: {derived}{first['msg']}", field=param) from None
    if method_type == "supervised":
        method = Method(
            type="supervised",
            supervised=SupervisedMethod(
                hyperparameters=SupervisedMethodHyperparameters.model_validate(resolved)
            ),
        )
    else:
        method = Method(
            type="dpo", dpo=DpoMethod(hyperparameters=DpoMethodHyperparameters.model_validate(resolved))
        )
    return spec, method


# --- run -> job, event, checkpoint ---------------------------------------------------------------------


def job_status(status: str, *, pause_requested: bool, cancel_requested: bool) -> str:
    """rlrun's status by OpenAI's name; a running run asked to pause is ``pausing`` (as OpenAI says)."""
    if status == "running" and pause_requested and not cancel_requested:
        return "pausing"
    return status


def method_from_spec(spec: dict[str, Any]) -> Method:
    """The method of a run made outside this surface: budgeted in steps, so ``n_epochs`` is ``auto``."""
    hp = spec.get("hyperparameters", {})
    # Relative to the default for the model's size where the name tells it (a preset), else for an
    # unknown size (the API picked a run's own default from the size it read at submit).
    default_lr = default_learning_rate(
        spec["algorithm"], preset_params_of(str(spec.get("model", ""))), lora=spec.get("adapter") is not None
    )
    lr = float(hp.get("learning_rate") or default_lr)
    common: dict[str, Any] = {
        "n_epochs": "auto",
        "batch_size": hp.get("batch_size", 8),
        # 12 significant digits: undoes the float noise of multiplier * default_lr / default_lr
        "learning_rate_multiplier": float(f"{lr / default_lr:.12g}"),
    }
    if spec["algorithm"] == "sft":
        return Method(
            type="supervised",
            supervised=SupervisedMethod(hyperparameters=SupervisedMethodHyperparameters(**common)),
        )
    if spec["algorithm"] == "grpo":
        grader = next(r["grader"] for r in spec.get("rewards", []) if r.get("grader"))
        rl_hp = ReinforcementMethodHyperparameters(
            **common | {"batch_size": hp.get("prompts_per_step", 8)},
            compute_multiplier=hp.get("samples_per_prompt", 4) / 4,
            eval_interval=hp.get("eval_every"),
            eval_samples=hp.get("eval_max_rows"),
        )
        return Method(
            type="reinforcement",
            reinforcement=ReinforcementMethod.model_validate({"grader": grader, "hyperparameters": rl_hp}),
        )
    beta = hp.get("beta", DpoSpecHyperparameters.model_fields["beta"].default)
    return Method(type="dpo", dpo=DpoMethod(hyperparameters=DpoMethodHyperparameters(**common, beta=beta)))


def job_object(run: Run, method: Method | None = None, trained_tokens: int | None = None) -> FineTuningJob:
    """OpenAI's job object for a run; ``method`` is the one recorded at creation (None: derive it);
    ``trained_tokens``: the run's last ``tokens/trained`` metric (reported once it succeeded)."""
    spec = run.spec
    method = method or method_from_spec(spec)
    config = {"supervised": method.supervised, "dpo": method.dpo, "reinforcement": method.reinforcement}[
        method.type
    ]
    given = config.hyperparameters if config is not None and config.hyperparameters else None
    validation = spec.get("validation_dataset_id")
    return FineTuningJob(
        id=job_id(run.id),
        created_at=unix(run.created_at),
        finished_at=unix(run.finished_at) if run.finished_at is not None else None,
        model=spec["model"],
        fine_tuned_model=f"run:{run.id}" if run.status == "succeeded" else None,
        organization_id=str(run.project_id),
        result_files=[result_file_id(run.id)] if run.status == "succeeded" else [],
        trained_tokens=trained_tokens if run.status == "succeeded" else None,
        status=job_status(
            run.status, pause_requested=run.pause_requested, cancel_requested=run.cancel_requested
        ),
        error=JobError(code="run_failed", message=run.error or "the run failed")
        if run.status == "failed"
        else None,
        hyperparameters=JobHyperparameters(
            n_epochs=given.n_epochs if given else None,
            batch_size=given.batch_size if given else None,
            learning_rate_multiplier=given.learning_rate_multiplier if given else None,
        ),
        method=method,
        seed=int(spec.get("hyperparameters", {}).get("seed", 0)),
        training_file=file_id(uuid.UUID(spec["dataset_id"])),
        validation_file=file_id(uuid.UUID(validation)) if validation else None,
        metadata=run.user_metadata,
        user_provided_suffix=spec.get("name"),
        integrations=integrations_of(spec),
    )


def event_level(kind: str, message: str) -> str:
    if kind == "warning":
        return "warn"
    if kind == "error" or (kind == "status" and message == "failed"):
        return "error"
    return "info"


def event_message(kind: str, message: str, data: dict[str, Any] | None) -> str:
    """Status changes read as sentences (OpenAI's job events do); other events keep rlrun's message."""
    if kind != "status":
        return message
    data = data or {}
    why = f" ({data['reason']})" if data.get("reason") else ""
    sentences = {
        "queued": f"Job queued{why}",
        "running": f"Job started (attempt {data.get('attempt', 1)})",
        "paused": f"Job paused{why}" if why else f"Job paused at step {data.get('step', 0)}",
        "succeeded": "The job has successfully completed",
        "failed": f"The job failed: {data.get('error') or 'see the run'}",
        "cancelled": f"The job was cancelled{why}",
    }
    return sentences.get(message, message)


def event_object(event: Event) -> JobEvent:
    return JobEvent(
        id=event_id(event.id),
        created_at=unix(event.created_at),
        level=event_level(event.kind, event.message),
        message=event_message(event.kind, event.message, event.data),
        data={"kind": event.kind, **(event.data or {})},
    )


def checkpoint_metrics(step: int, metrics: dict[str, Any]) -> CheckpointMetrics:
    """OpenAI's checkpoint metrics from rlrun's: training values from the step (or, at the final step,
    ``final/*`` over the whole training set), validation values from the latest ``eval/*``."""

    def first(*keys: str) -> float | None:
        return next((float(metrics[k]) for k in keys if k in metrics), None)

    return CheckpointMetrics(
        step=float(step),
        train_loss=first("loss", "final/loss"),
        train_mean_token_accuracy=first("token_accuracy", "final/token_accuracy"),
        valid_loss=first("eval/loss"),
        valid_mean_token_accuracy=first("eval/token_accuracy"),
    )


def checkpoint_object(ckpt: Checkpoint) -> JobCheckpoint:
    return JobCheckpoint(
        id=checkpoint_id(ckpt.run_id, ckpt.step),
        created_at=unix(ckpt.created_at),
        fine_tuned_model_checkpoint=f"run:{ckpt.run_id}@{ckpt.step}",
        fine_tuning_job_id=job_id(ckpt.run_id),
        metrics=checkpoint_metrics(ckpt.step, ckpt.metrics),
        step_number=ckpt.step,
    )
