"""runs.rendezvous: where a multi-host run's hosts meet ({endpoint, token, hosts}), written by the worker
that holds the run while it gathers the others, read by the workers that join it.

Revision ID: a8c0e2f4b6d8
Revises: f1b3d5e7a9c2
Create Date: 2026-12-06 23:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "a8c0e2f4b6d8"
down_revision: str | Sequence[str] | None = "f1b3d5e7a9c2"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("rendezvous", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("rendezvous")
