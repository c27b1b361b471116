"""Tables: datasets and their rows, runs, metrics and events (DESIGN "Data")."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    Uuid,
    text,
)
from sqlalchemy import false as sa_false
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from api.db import Base, UtcDateTime

JsonType = JSON().with_variant(JSONB(), "postgresql")

RUN_STATUSES = ("queued", "running", "paused", "succeeded", "failed", "cancelled")
FINISHED_STATUSES = ("succeeded", "failed", "cancelled")
PIPELINE_STATUSES = ("running", "succeeded", "failed", "cancelled")
DATASET_KINDS = ("preference", "sft", "ranking", "prompts", "unpaired")


# Every row belongs to a project. With auth off (loopback only) everything lives in this one.
DEFAULT_PROJECT_ID = uuid.UUID("00000000-0000-0000-0000-000000000001")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def utcnow() -> datetime:
    return datetime.now(UTC)


class Project(Base):
    """A tenant: API keys belong to one, and see only its datasets, runs and pipelines."""

    __tablename__ = "projects"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class ApiKey(Base):
    """An API key: shown once at creation; only its sha256 is stored (keys are 256-bit random)."""

    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    project_id: Mapped[uuid.UUID] = mapped_column(Uuid, ForeignKey("projects.id", ondelete="CASCADE"))
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)


class Dataset(Base):
    __tablename__ = "datasets"
    __table_args__ = (CheckConstraint(_one_of("kind", DATASET_KINDS), name="kind"),)

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    project_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("projects.id", ondelete="RESTRICT"), default=DEFAULT_PROJECT_ID, index=True
    )
    name: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    row_count: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(Integer)
    stats: Mapped[dict[str, Any]] = mapped_column(JsonType)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class DatasetRow(Base):
    __tablename__ = "dataset_rows"

    dataset_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("datasets.id", ondelete="CASCADE"), primary_key=True
    )
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[dict[str, Any]] = mapped_column(JsonType)
    content_hash: Mapped[str] = mapped_column(String(64))


class DatasetSkippedLine(Base):
    """A line that an upload with ``skip_invalid`` left out: its number in the file, why, and the field.
    Deleted with its dataset (ON DELETE CASCADE, like its rows)."""

    __tablename__ = "dataset_skipped_lines"

    dataset_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("datasets.id", ondelete="CASCADE"), primary_key=True
    )
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    reason: Mapped[str] = mapped_column(Text)
    field: Mapped[str | None] = mapped_column(Text, nullable=True)


class DatasetSource(Base):
    """The bytes an OpenAI file upload sent (``client.files.content`` answers them), gzip-compressed and
    cut into chunks of at most ``SOURCE_CHUNK`` compressed bytes, in order (``seq``), so neither writing
    nor reading holds a whole upload in memory. Deleted with its dataset (ON DELETE CASCADE)."""

    __tablename__ = "dataset_sources"

    dataset_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("datasets.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


def _spec_name(context: Any) -> str:
    spec = context.get_current_parameters().get("spec") or {}
    return str(spec.get("name") or "")[:200]


def run_tags(stored: str) -> list[str]:
    """A run's tags from its ``tags`` column (',a,b,': delimited so one LIKE finds a whole tag)."""
    return [t for t in stored.split(",") if t]


def stored_tags(tags: list[str]) -> str:
    return f",{','.join(tags)}," if tags else ""


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(_one_of("status", RUN_STATUSES), name="status"),
        Index("ix_runs_created_at_id", "created_at", "id"),
        Index("ix_runs_status", "status"),
        Index("ix_runs_warning_count", "warning_count"),
        # The webhook dispatcher's scan: finished runs whose webhooks are not yet queued (few rows).
        Index(
            "ix_runs_unannounced",
            "finished_at",
            postgresql_where=text("announced = false AND finished_at IS NOT NULL"),
            sqlite_where=text("announced = 0 AND finished_at IS NOT NULL"),
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    project_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("projects.id", ondelete="RESTRICT"), default=DEFAULT_PROJECT_ID, index=True
    )
    algorithm: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    spec: Mapped[dict[str, Any]] = mapped_column(JsonType)
    dataset_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("datasets.id", ondelete="RESTRICT"), nullable=True
    )
    idempotency_key: Mapped[str | None] = mapped_column(String(200), unique=True, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0, doc="Claims by a worker, resumes included.")
    lost_workers: Mapped[int] = mapped_column(
        Integer,
        default=0,
        server_default=text("0"),
        doc="Workers lost while they held the run (leases the reconciler found expired); "
        "`max_attempts` bounds this, so pausing and resuming never use up the budget.",
    )
    worker_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    enqueued_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    pause_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())
    step: Mapped[int] = mapped_column(Integer, default=0)
    phase: Mapped[str | None] = mapped_column(
        String(32), nullable=True, doc="The long phase a running run is in (model_load, reference, ...)."
    )
    phase_done: Mapped[int | None] = mapped_column(Integer, nullable=True)
    phase_total: Mapped[int | None] = mapped_column(Integer, nullable=True)
    warnings: Mapped[list[dict[str, Any]]] = mapped_column(
        JsonType,
        default=list,
        server_default=text("'[]'"),
        doc="[{code, step, message}] its health checks raised, each code once.",
    )
    warning_count: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    total_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    output_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    pipeline_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("pipelines.id", ondelete="SET NULL"), nullable=True, index=True
    )
    stage: Mapped[str | None] = mapped_column(String(64), nullable=True)
    user_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", JsonType, nullable=True)
    name: Mapped[str] = mapped_column(
        String(200),
        default=_spec_name,
        server_default=text("''"),
        doc="The spec's name ('' when it has none), a column so the runs list can sort and search it.",
    )
    tags: Mapped[str] = mapped_column(
        Text, default="", server_default=text("''"), doc="Its tags as ',a,b,' ('' for none): see run_tags."
    )
    note: Mapped[str | None] = mapped_column(Text, nullable=True)
    announced: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default=sa_false(), doc="Webhook deliveries for its end are queued."
    )
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    model_archived_at: Mapped[datetime | None] = mapped_column(
        UtcDateTime(), nullable=True, doc="When its model was archived (DELETE /v1/models/{model})."
    )
    result: Mapped[dict[str, float] | None] = mapped_column(
        JsonType, nullable=True, doc="The final metrics its loop returned, once it succeeded."
    )
    agent_gateway: Mapped[dict[str, str] | None] = mapped_column(
        JsonType,
        nullable=True,
        doc="Where a running agent run's or training session's gateway listens ({url, token}); the API "
        "proxies agents' and the tinker SDK's calls to it.",
    )
    rendezvous: Mapped[dict[str, Any] | None] = mapped_column(
        JsonType,
        nullable=True,
        doc="Where a multi-host run's hosts meet ({endpoint, token, hosts}): written by its lease holder "
        "while it gathers them, read by the workers that join it.",
    )


class Pipeline(Base):
    """Named stages, each a run spec; later stages refer to earlier ones as ``stage:<name>``."""

    __tablename__ = "pipelines"
    __table_args__ = (CheckConstraint(_one_of("status", PIPELINE_STATUSES), name="status"),)

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    project_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("projects.id", ondelete="RESTRICT"), default=DEFAULT_PROJECT_ID, index=True
    )
    name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="running")
    stages: Mapped[list[dict[str, Any]]] = mapped_column(JsonType)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)


class Metric(Base):
    __tablename__ = "metrics"
    # The live stream reads a run's metrics in the order they were logged (api/stream_hub.py).
    __table_args__ = (Index("ix_metrics_run_id_logged_at", "run_id", "logged_at", "key", "step"),)

    run_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[float] = mapped_column(Float)
    logged_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class MetricTier(Base):
    """A bucket of a key's series at one width: its lowest and highest point (api/metric_tiers.py).

    Written with the points by ``api.metric_store.write_points``; charts of long runs read these."""

    __tablename__ = "metric_tiers"

    run_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    width: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True)
    min_step: Mapped[int] = mapped_column(Integer)
    min_value: Mapped[float] = mapped_column(Float)
    max_step: Mapped[int] = mapped_column(Integer)
    max_value: Mapped[float] = mapped_column(Float)


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_id_id", "run_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[uuid.UUID] = mapped_column(Uuid, ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class Checkpoint(Base):
    """A resumable checkpoint folder of a run (the run's last one is its final model)."""

    __tablename__ = "checkpoints"

    run_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    metrics: Mapped[dict[str, Any]] = mapped_column(JsonType)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class RunSample(Base):
    """A completion stored during online RL with its reward, so users can spot reward hacking."""

    __tablename__ = "samples"
    __table_args__ = (Index("ix_samples_run_id_step", "run_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[uuid.UUID] = mapped_column(Uuid, ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    prompt: Mapped[str] = mapped_column(Text)
    completion: Mapped[str] = mapped_column(Text)
    reward: Mapped[float] = mapped_column(Float)
    data: Mapped[dict[str, Any]] = mapped_column(JsonType)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


WEBHOOK_EVENT_TYPES = ("run.succeeded", "run.failed", "run.cancelled")
DELIVERY_STATUSES = ("pending", "succeeded", "failed")


class Environment(Base):
    """A project's environment code (trainer/rollout/env_episodes.py): ``reset(row)`` and ``step(messages,
    row)``. Immutable; a run that names it by id stores its source in its own spec at submit, so deleting
    it leaves every run as it was."""

    __tablename__ = "environments"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    project_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("projects.id", ondelete="CASCADE"), default=DEFAULT_PROJECT_ID, index=True
    )
    name: Mapped[str] = mapped_column(String(200))
    source: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class Webhook(Base):
    """A project's endpoint: rlrun POSTs the run object there when one of its runs ends."""

    __tablename__ = "webhooks"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    project_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("projects.id", ondelete="CASCADE"), default=DEFAULT_PROJECT_ID, index=True
    )
    url: Mapped[str] = mapped_column(Text)
    description: Mapped[str | None] = mapped_column(String(200), nullable=True)
    event_types: Mapped[list[str]] = mapped_column(JsonType)
    secret: Mapped[str] = mapped_column(String(100), doc="Standard Webhooks signing secret, whsec_<base64>.")
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class WebhookDelivery(Base):
    """One message to one webhook, with every attempt to deliver it (the delivery log)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        CheckConstraint(_one_of("status", DELIVERY_STATUSES), name="status"),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_webhook_id_created_at", "webhook_id", "created_at"),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    webhook_id: Mapped[uuid.UUID] = mapped_column(Uuid, ForeignKey("webhooks.id", ondelete="CASCADE"))
    run_id: Mapped[uuid.UUID] = mapped_column(Uuid, ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    event_type: Mapped[str] = mapped_column(String(32))
    message_id: Mapped[str] = mapped_column(String(64), doc="webhook-id header: the same on every retry.")
    body: Mapped[str] = mapped_column(Text, doc="The exact JSON sent (and signed) on every attempt.")
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[list[dict[str, Any]]] = mapped_column(JsonType, default=list)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
