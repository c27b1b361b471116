"""Metric sinks a run mirrors its metrics to: an MLflow tracking server and Weights & Biases.

Pydantic only (the API imports it). The worker's side lives in ``trainer/metric_sinks.py`` (the clients)
and ``trainer/sink_mirror.py`` (the thread that feeds them); credentials never travel in a spec: the
worker's environment holds them (``MLFLOW_TRACKING_TOKEN`` / ``MLFLOW_TRACKING_USERNAME`` and
``_PASSWORD``, ``WANDB_API_KEY``), as the two clients read them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainer.specs.refs import refuse_nul

MAX_SINKS = 4
NAME_PATTERN = r"^[^\x00-\x1f]{1,200}$"  # printable: no control characters, NUL included


class _Sink(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MlflowSinkSpec(_Sink):
    """One MLflow run per rlrun run (tag ``rlrun.run_id``; a resumed attempt continues it)."""

    type: Literal["mlflow"]
    tracking_uri: str = Field(
        min_length=1,
        max_length=2000,
        description="The tracking server the worker writes to: `http://` or `https://` (a server started "
        "with `mlflow server`), or `file:` (a folder on the worker's disk). Credentials come from the "
        "worker's environment (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and _PASSWORD).",
    )
    experiment: str = Field(
        default="rlrun",
        pattern=NAME_PATTERN,
        description="Experiment name (created if missing).",
    )
    run_name: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="The MLflow run's name; default: the rlrun run's name, else its id.",
    )

    @field_validator("tracking_uri")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        refuse_nul(v, "tracking_uri")
        if not v.startswith(("http://", "https://", "file:")):
            raise ValueError("tracking_uri must start with http://, https:// or file:")
        return v


class WandbSinkSpec(_Sink):
    """One W&B run per rlrun run (its id: the rlrun run's id without dashes; a resumed attempt resumes it)."""

    type: Literal["wandb"]
    project: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$", description="W&B project.")
    entity: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_.-]{1,128}$", description="W&B entity (team or user)."
    )
    mode: Literal["online", "offline"] = Field(
        default="online",
        description="online: sent to W&B as it is logged (WANDB_API_KEY, and WANDB_BASE_URL for a "
        "self-hosted server, from the worker's environment). offline: written under the run's artifacts "
        "folder (`<artifacts>/runs/<id>/wandb`), for `wandb sync` later.",
    )
    name: str | None = Field(
        default=None, pattern=NAME_PATTERN, description="Display name; default: the rlrun run's name."
    )
    tags: list[Annotated[str, Field(pattern=r"^[^\x00-\x1f]{1,64}$")]] = Field(
        default_factory=list, max_length=20, description="W&B run tags."
    )


MetricSinkSpec = Annotated[MlflowSinkSpec | WandbSinkSpec, Field(discriminator="type")]
MetricSinks = Annotated[list[MetricSinkSpec], Field(max_length=MAX_SINKS)]

METRIC_SINKS_DOC = (
    "Mirror this run's metrics, its resolved spec (as params/config) and its checkpoint and output paths to "
    "MLflow and/or Weights & Biases, live, from the worker (batched in a thread of its own: a sink that is "
    "slow or down never slows or fails training; it is retried and reported as a run warning, and rlrun's "
    f"own store keeps every point either way). At most {MAX_SINKS}. null: the server's default "
    "(RLRUN_METRIC_SINKS); []: none. `rlrun runs export-metrics` sends a finished run after the fact."
)
