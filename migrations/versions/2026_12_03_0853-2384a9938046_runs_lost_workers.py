"""runs.lost_workers: how many workers a run lost (the retry budget), apart from `attempt` (every claim).

Pausing and resuming claims a run again, so `attempt` grows with every resume; the reconciler now bounds
`lost_workers` by `max_attempts` instead. Existing runs start at 0 (the count was never kept).

Revision ID: 2384a9938046
Revises: 01afe4d94b8b
Create Date: 2026-12-03 08:53:51.688713
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2384a9938046"
down_revision: str | Sequence[str] | None = "01afe4d94b8b"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("lost_workers", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("lost_workers")
