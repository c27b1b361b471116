"""metrics (run_id, logged_at, key, step) index: the live stream's read order.

Every poll of a run's stream reads the metrics logged since its cursor, ordered by (logged_at, key, step);
without this index each poll sorts all of the run's metrics (measured on 100k rows: 40 ms a poll, 1.4 ms
with it), and on SQLite holds the write lock meanwhile.

Revision ID: 5e1d2c3b4a69
Revises: b1cfe49a6052
Create Date: 2026-12-03 10:35:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "5e1d2c3b4a69"
down_revision: str | Sequence[str] | None = "b1cfe49a6052"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_metrics_run_id_logged_at", "metrics", ["run_id", "logged_at", "key", "step"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_metrics_run_id_logged_at", table_name="metrics")
