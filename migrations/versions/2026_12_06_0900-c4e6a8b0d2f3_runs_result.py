"""runs.result: the final metrics a run's loop returned (an eval's pass@k, mean reward and prompt count; a
training run's ``final/*`` metrics), so a run's answer carries its result without reading metrics.

Revision ID: c4e6a8b0d2f3
Revises: a3c5d7e9f1b2
Create Date: 2026-12-06 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "c4e6a8b0d2f3"
down_revision: str | Sequence[str] | None = "a3c5d7e9f1b2"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("result", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("result")
