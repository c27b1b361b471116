"""Allow dataset kind unpaired (KTO's desirable/undesirable answers) besides the others.

Revision ID: 9d2e4b7c1a08
Revises: 3f7a9c2e1d54
Create Date: 2026-12-04 17:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "9d2e4b7c1a08"
down_revision: str | Sequence[str] | None = "3f7a9c2e1d54"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD = "kind IN ('preference', 'sft', 'ranking', 'prompts')"
NEW = "kind IN ('preference', 'sft', 'ranking', 'prompts', 'unpaired')"


def upgrade() -> None:
    with op.batch_alter_table("datasets") as batch:
        batch.drop_constraint(op.f("ck_datasets_kind"), type_="check")
        batch.create_check_constraint("kind", NEW)


def downgrade() -> None:
    datasets = sa.table("datasets", sa.column("kind", sa.String))
    op.execute(sa.delete(datasets).where(datasets.c.kind == "unpaired"))
    with op.batch_alter_table("datasets") as batch:
        batch.drop_constraint(op.f("ck_datasets_kind"), type_="check")
        batch.create_check_constraint("kind", OLD)
