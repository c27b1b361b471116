"""metric_tiers: per key and bucket of steps, the lowest and highest point, for charts of long runs.

The 1,000-point chart query of a 50k-step key read all 50k points and downsampled them in Python
(127 ms on SQLite, 188 ms on PostgreSQL at 1M points); with tiers it reads some 2,000 bucket rows.
Tiers of the points already stored are computed here (api/metric_tiers.py), a key at a time.

Revision ID: 6b8e1f4a2c90
Revises: 9d2e4b7c1a08
Create Date: 2026-12-05 20:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from api.metric_tiers import TIER_WIDTHS, bucket_extremes

revision: str = "6b8e1f4a2c90"
down_revision: str | Sequence[str] | None = "9d2e4b7c1a08"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    tiers = op.create_table(
        "metric_tiers",
        sa.Column("run_id", sa.Uuid(), nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("min_step", sa.Integer(), nullable=False),
        sa.Column("min_value", sa.Float(), nullable=False),
        sa.Column("max_step", sa.Integer(), nullable=False),
        sa.Column("max_value", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_metric_tiers_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "key", "width", "bucket", name=op.f("pk_metric_tiers")),
    )
    conn = op.get_bind()
    metrics = sa.table(
        "metrics",
        sa.column("run_id", sa.Uuid()),
        sa.column("key", sa.String()),
        sa.column("step", sa.Integer()),
        sa.column("value", sa.Float()),
    )
    series = conn.execute(sa.select(metrics.c.run_id, metrics.c.key).distinct()).all()
    for run_id, key in series:
        points = conn.execute(
            sa.select(metrics.c.step, metrics.c.value)
            .where(metrics.c.run_id == run_id, metrics.c.key == key)
            .order_by(metrics.c.step)
        ).all()
        rows = [
            {"run_id": run_id, "key": key, "width": w, "bucket": b, **e._asdict()}
            for w in TIER_WIDTHS
            for b, e in bucket_extremes(((s, v) for s, v in points), w).items()
        ]
        if rows:
            op.bulk_insert(tiers, rows)


def downgrade() -> None:
    op.drop_table("metric_tiers")
