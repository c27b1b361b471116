"""Training sessions for the Tinker protocol (issue 40), as the API sees them: a model the SDK creates is a
``training_session`` run named ``{session}:train:{n}`` (the id the SDK itself derives), held by the worker
that claimed it; its calls go to that worker's session gateway, whose address the worker writes on the
run's row (``runs.agent_gateway``). Torch-free; never commits."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.models import FINISHED_STATUSES, Run

MODEL_ID = re.compile(r"^(?P<session>[0-9a-f]{32}):train:(?P<n>\d{1,9})$")
SAMPLER_ID = re.compile(r"^sampler\.(?P<run>[0-9a-f-]{36})\.(?P<name>[A-Za-z0-9_.-]{1,64})$")
SAMPLER_PATH = re.compile(
    r"^tinker://(?P<model>[0-9a-f]{32}:train:\d{1,9})/sampler_weights/(?P<name>[A-Za-z0-9_.-]{1,64})$"
)
STATE_PATH = re.compile(
    r"^tinker://(?P<model>[0-9a-f]{32}:train:\d{1,9})/weights/(?P<name>[A-Za-z0-9_.-]{1,64})$"
)
FUTURE_ID = re.compile(r"^(?P<kind>create|load|cmd)\.(?P<run>[0-9a-f-]{36})(?:\.(?P<n>\d{1,12}))?$")


class TinkerError(Exception):
    """An answer the SDK maps to its own exception types: ``status`` (4xx, never retried by it) and a
    message naming ``field``."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.message, self.field = status, message, field

    def body(self) -> dict[str, Any]:
        return {"detail": self.message, "field": self.field}


@dataclass(frozen=True)
class Held:
    """A running session's worker: where its gateway is, and the model folder it loaded."""

    run_id: uuid.UUID
    url: str
    token: str
    model_path: str | None


def session_model(session: Session, project_id: uuid.UUID, model_id: str) -> Run:
    """The run of ``model_id`` in the project.

    Raises:
        TinkerError: 404, no such model.
    """
    if not MODEL_ID.match(model_id or ""):
        raise TinkerError(404, f"no model {model_id!r}; model ids look like <session>:train:<n>", "model_id")
    run = session.scalars(
        select(Run).where(
            Run.project_id == project_id, Run.name == model_id, Run.algorithm == "training_session"
        )
    ).first()
    if run is None:
        raise TinkerError(404, f"no model {model_id!r} in this project", "model_id")
    return run


def held(run: Run) -> Held | None:
    """Where the run's session is served, None while it is not (queued, loading).

    Raises:
        TinkerError: 400, the session is over (the run finished).
    """
    if run.status in FINISHED_STATUSES:
        why = f": {run.error}" if run.error else ""
        raise TinkerError(
            400, f"the session of {run.name} is over (its run {run.id} {run.status}{why})", "model_id"
        )
    address = run.agent_gateway
    if run.status != "running" or not address:
        return None
    return Held(run.id, str(address["url"]), str(address["token"]), address.get("model_path"))


def session_runs(session: Session, project_id: uuid.UUID, session_id: str) -> list[Run]:
    """The runs of a session's models, not finished."""
    return list(
        session.scalars(
            select(Run).where(
                Run.project_id == project_id,
                Run.algorithm == "training_session",
                Run.name.startswith(f"{session_id}:train:"),
                Run.status.not_in(FINISHED_STATUSES),
            )
        )
    )


def session_run(session: Session, project_id: uuid.UUID, run_id: uuid.UUID, request_id: str) -> Run:
    """The session run a future belongs to.

    Raises:
        TinkerError: 404, no such run in the project (as an unknown request).
    """
    run = session.get(Run, run_id)
    if run is None or run.project_id != project_id or run.algorithm != "training_session":
        raise TinkerError(404, f"no request {request_id!r}", "request_id")
    return run


def session_runs_page(
    session: Session, project_id: uuid.UUID, limit: int, offset: int
) -> tuple[list[Run], int]:
    """The project's session runs, newest first, and how many there are."""
    where = (Run.project_id == project_id, Run.algorithm == "training_session")
    total = session.scalar(select(func.count()).select_from(Run).where(*where)) or 0
    runs = session.scalars(
        select(Run).where(*where).order_by(Run.created_at.desc()).offset(offset).limit(limit)
    )
    return list(runs), int(total)


def saved_states(artifacts: Path, run: Run) -> list[dict[str, Any]]:
    """The states a session run saved (``save_state``: training checkpoints in the SDK's listing), newest
    first; sampler snapshots live in the worker's memory and are not listed."""
    folder = artifacts / "runs" / str(run.id) / "checkpoints" / "weights"
    found = (
        [f for f in folder.iterdir() if f.is_dir() and not f.name.endswith(".partial")]
        if folder.is_dir()
        else []
    )
    out = []
    for f in sorted(found, key=lambda f: f.stat().st_mtime, reverse=True):
        out.append(
            {
                "checkpoint_id": f"weights/{f.name}",
                "checkpoint_type": "training",
                "time": datetime.fromtimestamp(f.stat().st_mtime, UTC).isoformat(),
                "tinker_path": f"tinker://{run.name}/weights/{f.name}",
                "size_bytes": sum(p.stat().st_size for p in f.rglob("*") if p.is_file()),
            }
        )
    return out


def training_run(run: Run, artifacts: Path) -> dict[str, Any]:
    """A session run as the SDK's ``TrainingRun``."""
    spec = run.spec or {}
    states = saved_states(artifacts, run)
    last = run.finished_at or run.started_at or run.created_at
    return {
        "training_run_id": run.name,
        "base_model": str(spec.get("model", "")),
        "model_owner": str(run.project_id),
        "is_lora": True,
        "lora_rank": int((spec.get("hyperparameters") or {}).get("lora_rank", 32)),
        "last_request_time": last.isoformat() if last else datetime.now(UTC).isoformat(),
        "last_checkpoint": states[0] if states else None,
        "last_sampler_checkpoint": None,
    }
