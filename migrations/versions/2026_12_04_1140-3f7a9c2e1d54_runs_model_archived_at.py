"""runs.model_archived_at: when the run's model was archived (OpenAI's ``DELETE /v1/models/{model}``).

An archived model is no longer listed, retrieved, served or accepted as a spec's model; its files and the
run's record, metrics and checkpoints stay (archive, not delete).

Revision ID: 3f7a9c2e1d54
Revises: 8c1f0a2d7b31
Create Date: 2026-12-04 11:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "3f7a9c2e1d54"
down_revision: str | Sequence[str] | None = "8c1f0a2d7b31"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("model_archived_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("model_archived_at")
