"""runs.phase / phase_done / phase_total (the long phase a running run is in) and runs.warnings /
warning_count (what its health checks flagged).

A run that loads a model, tokenises, computes reference log-probs, evaluates or writes a checkpoint now
says so (``progress.phase``) instead of showing ``step 0/N``; ``warning_count`` makes
``GET /v1/runs?flagged=true`` one indexed comparison on both backends (no JSON functions).

Revision ID: 8c1f0a2d7b31
Revises: 5e1d2c3b4a69
Create Date: 2026-12-03 15:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "8c1f0a2d7b31"
down_revision: str | Sequence[str] | None = "5e1d2c3b4a69"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("phase", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("phase_done", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("phase_total", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column(
                "warnings",
                sa.JSON().with_variant(postgresql.JSONB(), "postgresql"),
                server_default=sa.text("'[]'"),
                nullable=False,
            ))
        batch_op.add_column(
            sa.Column("warning_count", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )
        batch_op.create_index("ix_runs_warning_count", ["warning_count"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index("ix_runs_warning_count")
        batch_op.drop_column("warning_count")
        batch_op.drop_column("warnings")
        batch_op.drop_column("phase_total")
        batch_op.drop_column("phase_done")
        batch_op.drop_column("phase")
