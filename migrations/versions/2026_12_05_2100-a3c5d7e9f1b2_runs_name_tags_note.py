"""runs.name, runs.tags, runs.note: the runs list sorts and searches by name, filters by tag; a note per run.

``name`` copies the spec's name (sortable and searchable without reading JSON); ``tags`` holds
',a,b,' (lowercase) so that one portable LIKE finds a whole tag on SQLite and PostgreSQL.

Revision ID: a3c5d7e9f1b2
Revises: 6b8e1f4a2c90
Create Date: 2026-12-05 21:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a3c5d7e9f1b2"
down_revision: str | Sequence[str] | None = "6b8e1f4a2c90"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN, not batch mode: batch mode copies the table and drops the old one, and on SQLite
    # with foreign keys on that DROP cascades to every run's metrics, events and checkpoints.
    op.add_column(
        "runs", sa.Column("name", sa.String(length=200), server_default=sa.text("''"), nullable=False)
    )
    op.add_column("runs", sa.Column("tags", sa.Text(), server_default=sa.text("''"), nullable=False))
    op.add_column("runs", sa.Column("note", sa.Text(), nullable=True))
    conn = op.get_bind()
    runs = sa.table("runs", sa.column("id", sa.Uuid()), sa.column("spec", sa.JSON()), sa.column("name"))
    for run_id, spec in conn.execute(sa.select(runs.c.id, runs.c.spec)).all():
        name = str((spec or {}).get("name") or "")[:200]
        if name:
            conn.execute(sa.update(runs).where(runs.c.id == run_id).values(name=name))


def downgrade() -> None:
    for column in ("note", "tags", "name"):  # plain DROP COLUMN (SQLite >= 3.35), for the reason above
        op.drop_column("runs", column)
