"""Pause and resume: runs.pause_requested and the 'paused' status.

Revision ID: deee915ec12f
Revises: 7ae2e1229a0b
Create Date: 2026-12-02 16:11:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "deee915ec12f"
down_revision: str | Sequence[str] | None = "7ae2e1229a0b"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD = "status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')"
NEW = "status IN ('queued', 'running', 'paused', 'succeeded', 'failed', 'cancelled')"


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pause_requested", sa.Boolean(), server_default=sa.false(), nullable=False))
        batch_op.drop_constraint(op.f("ck_runs_status"), type_="check")
        batch_op.create_check_constraint("status", NEW)


def downgrade() -> None:
    runs = sa.table("runs", sa.column("status", sa.String))
    op.execute(sa.update(runs).where(runs.c.status == "paused").values(status="cancelled"))
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_runs_status"), type_="check")
        batch_op.create_check_constraint("status", OLD)
        batch_op.drop_column("pause_requested")
