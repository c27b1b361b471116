"""Service settings, read from ``RLRUN_*`` environment variables.

Defaults are the embedded mode: everything lives under ``RLRUN_HOME`` (a SQLite database, a SQLite file
for the broker's queue tables, and the artifacts folder), so ``rlrun serve`` needs no server.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainer.specs.sinks import MetricSinks


class Settings(BaseSettings):
    """Everything the API and the worker read from the environment."""

    model_config = SettingsConfigDict(env_prefix="RLRUN_", extra="ignore")

    home: Path = Field(
        default=Path(".rlrun"), description="Folder for the embedded DB, broker and artifacts."
    )
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default: SQLite file <home>/rlrun.db."
    )
    broker_url: str | None = Field(
        default=None,
        description="Celery broker URL; default: kombu's SQL transport on SQLite file <home>/broker.db.",
    )
    artifacts_dir: Path | None = Field(
        default=None, description="Where runs write models; default <home>/artifacts."
    )
    cache_dir: Path | None = Field(
        default=None, description="Where built-in tiny model presets are built once; default <home>/cache."
    )
    model_roots: list[Path] = Field(
        default_factory=list,
        description="Folders local model paths and model names may point into (besides <home>/models). "
        "Run outputs are not among them: name those `run:<id>`, which checks the "
        "caller's project.",
    )
    allow_hub: bool = Field(
        default=False,
        description="Let runs name hub ids (`org/name`) that are not a folder under the model roots; the "
        "worker downloads them. Off: a name must be a preset, a folder under a model root or a run.",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Allow models whose code ships with the weights (off: it runs arbitrary code).",
    )
    auth: bool = Field(
        default=False,
        description="Require `Authorization: Bearer <key>` (from `rlrun keys create`). Off is allowed only "
        "when serving on a loopback host: everything then lives in one default project.",
    )
    worker_devices: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="The most devices (GPUs, or CPU ranks) any worker of this deployment has: a run whose "
        "`resources.devices` asks for more is refused at submit (422). Unset: each worker checks when it "
        "starts the run and fails it, saying how many it sees.",
    )
    worker_hosts: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="How many worker hosts this deployment has to gather for one run: a run whose "
        "`resources.nodes` asks for more is refused at submit (422), as it could never start. Unset: such a "
        "run waits, going back to the queue after each RLRUN_RENDEZVOUS_TIMEOUT_SECONDS.",
    )
    host_address: str | None = Field(
        default=None,
        description="The address the other hosts of a multi-host run (`resources.nodes > 1`) reach this "
        "worker at, for the run's rendezvous and its ranks' process group (unset: this host's fully "
        "qualified name).",
    )
    rendezvous_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        description="How long the hosts of a multi-host run wait for each other (torch's rendezvous join "
        "timeout). After it none of them trains and the run goes back to the queue, saying how many came.",
    )
    engine_python: str | None = Field(
        default=None,
        description="Python of the generation engine's environment, for runs with `engine: vllm_server` "
        "(`make engine` builds `.venv-engine`; unset: `.venv-engine/bin/python` beside the project). Such a "
        "run is refused at submit (422) when the file does not exist where the API runs; workers start the "
        "engine with it.",
    )
    engine_url: str | None = Field(
        default=None,
        description="A running generation engine (`rlrun engine` prints its URL) that workers' `engine: "
        "vllm_server` runs use instead of starting one each: on the worker's host (weights reach it as "
        "files), one run at a time. Set where the API runs too, runs asking for the engine are accepted "
        "without `RLRUN_ENGINE_PYTHON` there.",
    )
    max_runs_in_flight: int = Field(
        default=1000, ge=1, description="Queued, running or paused runs one project may have (429 above)."
    )
    max_streams_per_client: int = Field(
        default=32,
        ge=1,
        description="Live event streams (SSE) one API key may hold open at once (one client address when "
        "auth is off); 429 above.",
    )
    inference_url: str | None = Field(
        default=None,
        description="Where the API forwards /v1/chat/completions and /v1/completions (the `rlrun inference` "
        "process). `rlrun serve` starts one on a free loopback port and sets this; unset otherwise: those "
        "routes answer 503.",
    )
    inference_port: int = Field(default=8001, description="Port of `rlrun inference` (loopback only).")
    inference_max_models: int = Field(
        default=2, ge=1, le=64, description="Models `rlrun inference` keeps loaded (least recently used go)."
    )
    inference_backend: Literal["hf", "vllm", "vllm_server"] = Field(
        default="hf",
        description="How `rlrun inference` decodes: `hf` (transformers, CPU or GPU; one request at a time), "
        "`vllm_server` (a vLLM engine process per model from the engine environment, `make engine`, any "
        "machine; concurrent requests batched continuously) or `vllm` (vLLM in the inference process, GPU; "
        "run it from an environment with vLLM installed). docs/settings.md.",
    )
    inference_max_context: int = Field(
        default=4096,
        ge=16,
        le=1_048_576,
        description="vllm_server backend: the longest prompt + completion an engine holds (its "
        "max_model_len; the model's own limit when lower). Longer requests get a 400 naming the limit.",
    )
    inference_gpu_memory_utilization: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description="vllm backend: the share of GPU memory its engines take together (weights and KV cache), "
        "split evenly between RLRUN_INFERENCE_MAX_MODELS engines.",
    )
    inference_max_lora_rank: int = Field(
        default=64,
        ge=1,
        description="vllm and vllm_server backends: the largest LoRA rank of an adapter run they serve.",
    )
    queue: str = Field(default="rlrun", description="Celery queue that runs are sent to.")
    port: int = Field(default=8000, description="Port of `rlrun serve`.")
    host: str = Field(default="127.0.0.1", description="Interface of `rlrun serve`.")
    max_upload_bytes: int = Field(
        default=200 * 1024 * 1024, description="Largest dataset upload (413 above)."
    )
    max_line_bytes: int = Field(default=8 * 1024 * 1024, ge=1, description="Longest JSONL line of an upload.")
    max_dataset_rows: int = Field(
        default=1_000_000, ge=1, description="Most rows in one dataset (413 above)."
    )
    lease_seconds: int = Field(
        default=120, description="A worker's claim on a run lasts this long between heartbeats."
    )
    max_attempts: int = Field(
        default=3, ge=1, description="A run whose worker is lost this many times ends failed."
    )
    reconcile_seconds: float = Field(
        default=10.0, gt=0, description="How often `rlrun serve` reconciles runs with workers and the broker."
    )
    resend_after_seconds: float = Field(
        default=300.0, gt=0, description="Re-send a run id that has sat queued this long (a lost message)."
    )
    broker_polling_interval: float = Field(
        default=0.05, description="Seconds between queue polls of the SQL broker (kombu's default is 1 s)."
    )
    metric_sinks: MetricSinks = Field(
        default_factory=list,
        description="The worker's default metric sinks (JSON, as a spec's `metric_sinks`), for runs whose "
        'spec leaves them null: e.g. `[{"type": "mlflow", "tracking_uri": "http://mlflow:5000"}]`.',
    )
    webhook_allowed_hosts: list[str] = Field(
        default_factory=list,
        description="If set, webhook URLs must name one of these hosts (`*.example.com` matches subdomains).",
    )
    webhook_allowed_networks: list[str] = Field(
        default_factory=list,
        description="Private networks (CIDR) webhook hosts may resolve into; public addresses are always "
        "allowed, other non-public ones never.",
    )
    webhook_allow_loopback: bool = Field(
        default=False, description="Allow webhook URLs on loopback addresses (tests, one-machine setups)."
    )
    webhook_timeout_seconds: float = Field(default=10.0, gt=0, description="Timeout of one delivery attempt.")
    webhook_max_attempts: int = Field(
        default=8, ge=1, le=50, description="Attempts per delivery before it is given up as failed."
    )
    webhook_backoff_seconds: float = Field(
        default=5.0, gt=0, description="Wait before the 2nd attempt; doubles after each failure."
    )
    webhook_max_backoff_seconds: float = Field(
        default=3600.0, gt=0, description="Longest wait between two attempts."
    )
    webhook_poll_seconds: float = Field(
        default=1.0, gt=0, description="How often `rlrun serve` looks for ended runs and due deliveries."
    )

    @field_validator("webhook_allowed_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for net in value:
            ipaddress.ip_network(net, strict=False)  # ValueError names the bad entry
        return value

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'rlrun.db').resolve()}"

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{(self.home / 'broker.db').resolve()}"

    @property
    def resolved_artifacts_dir(self) -> Path:
        return (self.artifacts_dir or self.home / "artifacts").resolve()

    @property
    def resolved_model_roots(self) -> list[Path]:
        # Not the artifacts folder: it holds every project's run outputs (reach those as run:<id>). Not the
        # cache either: presets are named tiny:<preset>.
        return [*self.model_roots, (self.home / "models").resolve()]

    @property
    def resolved_cache_dir(self) -> Path:
        return (self.cache_dir or self.home / "cache").resolve()


@lru_cache
def get_settings() -> Settings:
    """The process's settings (cached; tests override the dependency instead)."""
    return Settings()
