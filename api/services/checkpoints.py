"""A run's checkpoints as the API reads them. Never commits (the worker writes them: trainer/worker.py)."""

from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.models import Checkpoint


def list_checkpoints(*, session: Session, run_id: uuid.UUID) -> list[Checkpoint]:
    """The run's kept checkpoints, oldest first (a run keeps few: ``keep_last_checkpoints``)."""
    return list(
        session.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step))
    )


def get_checkpoint(*, session: Session, run_id: uuid.UUID, step: int) -> Checkpoint | None:
    """The run's checkpoint at ``step``, if it was kept."""
    return session.get(Checkpoint, (run_id, step))


def checkpoints_of_runs(*, session: Session, run_ids: list[uuid.UUID]) -> list[Checkpoint]:
    """The checkpoints of these runs, by run then step."""
    if not run_ids:
        return []
    stmt = (
        select(Checkpoint).where(Checkpoint.run_id.in_(run_ids)).order_by(Checkpoint.run_id, Checkpoint.step)
    )
    return list(session.scalars(stmt))
