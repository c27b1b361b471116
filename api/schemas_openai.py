"""Request and response bodies of the OpenAI-compatible surface (/v1/files, /v1/fine_tuning/jobs).

Field names, types and status names follow the official SDK's models (``openai.types.FileObject``,
``openai.types.fine_tuning.FineTuningJob`` and friends), so code written against OpenAI's fine-tuning API
runs unchanged; the descriptions say how each maps onto rlrun's datasets and runs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema

from api.schemas import NulFreeStr
from trainer.specs.graders import Grader

MetadataKey = Annotated[NulFreeStr, Field(max_length=64)]
MetadataValue = Annotated[NulFreeStr, Field(max_length=512)]


def _auto_or(
    kind: type[int] | type[float], low: float, high: float, *, above: bool = False
) -> PlainValidator:
    """A validator of ``"auto"`` or a number in range. One validator rather than a union: pydantic reports a
    union's errors under member tags (``n_epochs.literal['auto']``) instead of the parameter's own name."""
    noun = "an integer" if kind is int else "a number"
    message = f"must be 'auto' or {noun} {'above' if above else 'from'} {low:g} up to {high:g}"

    def check(value: object) -> object:
        if value == "auto":
            return "auto"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(message)
        if (kind is int and not float(value).is_integer()) or not (
            low < value <= high if above else low <= value <= high
        ):
            raise ValueError(message)
        return kind(value)

    return PlainValidator(check)


def _auto_schema(
    kind: type[int] | type[float], low: float, high: float, *, above: bool = False
) -> WithJsonSchema:
    number: dict[str, Any] = {"type": "integer" if kind is int else "number", "maximum": high}
    number["exclusiveMinimum" if above else "minimum"] = low
    return WithJsonSchema({"anyOf": [{"type": "string", "enum": ["auto"]}, number]})


NEpochs = Annotated[Literal["auto"] | int, _auto_or(int, 1, 1000), _auto_schema(int, 1, 1000)]
BatchSize = Annotated[Literal["auto"] | int, _auto_or(int, 1, 4096), _auto_schema(int, 1, 4096)]
LrMultiplier = Annotated[
    Literal["auto"] | float, _auto_or(float, 0, 1e6, above=True), _auto_schema(float, 0, 1e6, above=True)
]
Beta = Annotated[
    Literal["auto"] | float, _auto_or(float, 0, 100, above=True), _auto_schema(float, 0, 100, above=True)
]
JobStatus = Literal[
    "validating_files", "queued", "running", "pausing", "paused", "succeeded", "failed", "cancelled"
]
MethodType = Literal["supervised", "dpo", "reinforcement"]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- files ---------------------------------------------------------------------------------------------


class FileObject(BaseModel):
    """An uploaded file: an rlrun dataset (kind `sft` or `preference`, detected from its lines)."""

    id: str = Field(description="`file-<dataset id hex>`, or `file-results-<run id hex>` for a result file.")
    object: Literal["file"] = "file"
    bytes: int = Field(description="Size of the upload.")
    created_at: int = Field(description="Unix seconds.")
    filename: str = Field(description="The uploaded file's name (the dataset's name).")
    purpose: Literal["fine-tune", "fine-tune-results"] = Field(
        default="fine-tune",
        description="`fine-tune` for an upload; `fine-tune-results` for a job's metrics CSV (its "
        "`result_files`, `file-results-<run id hex>`).",
    )
    status: Literal["uploaded", "processed", "error"] = Field(
        default="processed",
        description="Always `processed`: a file is validated in full before it is stored.",
    )
    expires_at: int | None = Field(default=None, description="Never: rlrun files do not expire.")
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


# --- fine-tuning jobs ----------------------------------------------------------------------------------


class SupervisedMethodHyperparameters(_In):
    """`auto` picks: 3 epochs, the spec's default batch size (8, at most the file's rows), multiplier 1."""

    n_epochs: NEpochs | None = Field(
        default=None, description="Passes over the file: max_steps = ceil(n_epochs * rows / batch_size)."
    )
    batch_size: BatchSize | None = Field(default=None, description="Examples per optimizer step.")
    learning_rate_multiplier: LrMultiplier | None = Field(
        default=None, description="Times the run type's default learning rate (SFT 2e-5, DPO 1e-6)."
    )


class DpoMethodHyperparameters(SupervisedMethodHyperparameters):
    beta: Beta | None = Field(
        default=None, description="DPO's KL strength to the reference model (`auto`: 0.1)."
    )


ComputeMultiplier = Annotated[
    Literal["auto"] | float, _auto_or(float, 0, 64, above=True), _auto_schema(float, 0, 64, above=True)
]
Interval = Annotated[Literal["auto"] | int, _auto_or(int, 1, 1_000_000), _auto_schema(int, 1, 1_000_000)]


class ReinforcementMethodHyperparameters(SupervisedMethodHyperparameters):
    """`auto` picks: 1 epoch, batch min(8, rows) prompts, multiplier 1, compute multiplier 1 (4 samples
    per prompt), eval every 10 steps on up to 64 validation prompts (docs/openai.md, "Reinforcement")."""

    compute_multiplier: ComputeMultiplier | None = Field(
        default=None,
        description="Samples per prompt (the group size) relative to 4: round(4 x multiplier), at least 2.",
    )
    eval_interval: Interval | None = Field(default=None, description="Steps between validation evals.")
    eval_samples: Interval | None = Field(
        default=None, description="Validation prompts each eval reads (greedy answers, graded)."
    )
    reasoning_effort: Literal["default", "low", "medium", "high"] | None = Field(
        default=None,
        description="OpenAI's reasoning models only: refused unless `default` (rlrun trains the model as "
        "it is).",
    )


class ReinforcementMethod(_In):
    grader: Grader = Field(description="The reward: string_check, text_similarity, python or multi.")
    hyperparameters: ReinforcementMethodHyperparameters | None = None


class SupervisedMethod(_In):
    hyperparameters: SupervisedMethodHyperparameters | None = None


class DpoMethod(_In):
    hyperparameters: DpoMethodHyperparameters | None = None


class Method(_In):
    """`supervised` -> an rlrun `sft` run (file of chat `messages` lines); `dpo` -> a `dpo` run (file of
    `input`/`preferred_output`/`non_preferred_output` lines); `reinforcement` -> a `grpo` run rewarded by
    the grader (file of chat `messages` lines ending in a user turn, with the fields the grader reads)."""

    type: MethodType
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    reinforcement: ReinforcementMethod | None = None


class FineTuningJobCreate(_In):
    """OpenAI's job request; it becomes an rlrun run through the same checks as `POST /v1/runs`."""

    model: str = Field(
        min_length=1,
        description="An rlrun model reference: `tiny:llama-0.4m`, `run:<id>`, `run:<id>@<step>`, a path.",
    )
    training_file: str = Field(description="`file-...` id of an uploaded file.")
    validation_file: str | None = Field(default=None, description="A file of the same kind, for eval/*.")
    method: Method | None = Field(default=None, description="Default: supervised.")
    hyperparameters: SupervisedMethodHyperparameters | None = Field(
        default=None,
        description="Deprecated by OpenAI in favour of `method`: the supervised hyperparameters.",
    )
    suffix: NulFreeStr | None = Field(
        default=None, min_length=1, max_length=64, description="Becomes the run's name."
    )
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1, description="Default: a random seed.")
    metadata: dict[MetadataKey, MetadataValue] | None = Field(
        default=None, max_length=16, description="Up to 16 string pairs, stored with the run."
    )
    integrations: list[dict[str, Any]] | None = Field(
        default=None,
        max_length=4,
        description='W&B only, as OpenAI has it: `{"type": "wandb", "wandb": {"project": ..., "name": ..., '
        '"entity": ..., "tags": [...]}}`. The run mirrors its metrics to that W&B run from the worker, '
        "online, with the worker's WANDB_API_KEY (a run spec's `metric_sinks`).",
    )


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class JobHyperparameters(BaseModel):
    n_epochs: NEpochs | None = None
    batch_size: BatchSize | None = None
    learning_rate_multiplier: LrMultiplier | None = None


class FineTuningJob(BaseModel):
    """A fine-tuning job: an rlrun `sft`, `dpo` or (reinforcement) `grpo` run, seen through OpenAI's job
    object."""

    id: str = Field(description="`ftjob-<run id hex>`.")
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    finished_at: int | None
    model: str
    fine_tuned_model: str | None = Field(description="`run:<id>` once succeeded: use it as `model` anywhere.")
    organization_id: str = Field(description="The rlrun project id.")
    result_files: list[str] = Field(
        description="Once succeeded: the job's metrics as a CSV file (`step_metrics.csv`, one line per "
        "step), readable with `GET /v1/files/{file_id}/content`."
    )
    status: JobStatus = Field(description="rlrun's status; `pausing` while a pause is requested.")
    error: JobError | None
    hyperparameters: JobHyperparameters
    method: Method
    seed: int
    training_file: str
    validation_file: str | None
    trained_tokens: int | None = Field(
        default=None,
        description="Once succeeded: the non-padding tokens of every training batch, summed over steps.",
    )
    metadata: dict[str, str] | None
    user_provided_suffix: str | None
    estimated_finish: int | None = None
    integrations: list[dict[str, Any]] | None = None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJob]
    has_more: bool


class JobEvent(BaseModel):
    id: str = Field(description="`ftevent-<rlrun event id>`.")
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] | None = None
    type: Literal["message", "metrics"] = "message"


class JobEventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobEvent]
    has_more: bool


class CheckpointMetrics(BaseModel):
    step: float | None = None
    train_loss: float | None = None
    train_mean_token_accuracy: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None


class JobCheckpoint(BaseModel):
    id: str = Field(description="`ftckpt-<run id hex>-<step>`.")
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str = Field(description="`run:<id>@<step>`: usable as `model` anywhere.")
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int


class JobCheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobCheckpoint]
    first_id: str | None
    last_id: str | None
    has_more: bool


def hyperparameter_number(value: str | float | None, auto: float) -> float:
    """A job hyperparameter as given, or ``auto``'s value when it is None or "auto" (the only string)."""
    return auto if value is None or isinstance(value, str) else float(value)
