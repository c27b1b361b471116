"""dataset_skipped_lines: the lines an upload with `skip_invalid` left out (line number, reason, field).

One row per skipped line, deleted with its dataset. Existing datasets were uploaded atomically: they have
none.

Revision ID: b1cfe49a6052
Revises: 2384a9938046
Create Date: 2026-12-03 09:34:33.079974
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b1cfe49a6052"
down_revision: str | Sequence[str] | None = "2384a9938046"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dataset_skipped_lines",
        sa.Column("dataset_id", sa.Uuid(), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("field", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["dataset_id"],
            ["datasets.id"],
            name=op.f("fk_dataset_skipped_lines_dataset_id_datasets"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("dataset_id", "line", name=op.f("pk_dataset_skipped_lines")),
    )


def downgrade() -> None:
    op.drop_table("dataset_skipped_lines")
