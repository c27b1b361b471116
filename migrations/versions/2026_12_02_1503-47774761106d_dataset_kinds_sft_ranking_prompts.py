"""Allow dataset kinds sft, ranking and prompts besides preference.

Revision ID: 47774761106d
Revises: 41b5aa0c07d5
Create Date: 2026-12-02 15:03:33.904778
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '47774761106d'
down_revision: str | Sequence[str] | None = '41b5aa0c07d5'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


OLD = "kind IN ('preference')"
NEW = "kind IN ('preference', 'sft', 'ranking', 'prompts')"


def upgrade() -> None:
    with op.batch_alter_table("datasets") as batch:
        batch.drop_constraint(op.f("ck_datasets_kind"), type_="check")
        batch.create_check_constraint("kind", NEW)


def downgrade() -> None:
    datasets = sa.table("datasets", sa.column("kind", sa.String))
    op.execute(sa.delete(datasets).where(datasets.c.kind != "preference"))
    with op.batch_alter_table("datasets") as batch:
        batch.drop_constraint(op.f("ck_datasets_kind"), type_="check")
        batch.create_check_constraint("kind", OLD)
