"""Projects and API keys; every dataset, run and pipeline belongs to a project.

Existing rows move to the default project (the one auth-off mode uses).

Revision ID: a96fa9f29bb6
Revises: deee915ec12f
Create Date: 2026-12-02 16:17:00
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "a96fa9f29bb6"
down_revision: str | Sequence[str] | None = "deee915ec12f"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT_PROJECT_ID = uuid.UUID("00000000-0000-0000-0000-000000000001")
TABLES = ("datasets", "pipelines", "runs")


def upgrade() -> None:
    op.create_table(
        "projects",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_projects")),
        sa.UniqueConstraint("name", name=op.f("uq_projects_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("project_id", sa.Uuid(), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], name=op.f("fk_api_keys_project_id_projects"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("prefix", name=op.f("uq_api_keys_prefix")),
    )
    projects = sa.table("projects", sa.column("id", sa.Uuid()), sa.column("name", sa.String),
                        sa.column("created_at", sa.DateTime(timezone=True)))
    op.execute(sa.insert(projects).values(id=DEFAULT_PROJECT_ID, name="default", created_at=datetime.now(UTC)))
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("project_id", sa.Uuid(), nullable=True))
        stub = sa.table(table, sa.column("project_id", sa.Uuid()))
        op.execute(sa.update(stub).values(project_id=DEFAULT_PROJECT_ID))
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.alter_column("project_id", existing_type=sa.Uuid(), nullable=False)
            batch_op.create_index(batch_op.f(f"ix_{table}_project_id"), ["project_id"], unique=False)
            batch_op.create_foreign_key(batch_op.f(f"fk_{table}_project_id_projects"), "projects", ["project_id"],
                                        ["id"], ondelete="RESTRICT")


def downgrade() -> None:
    for table in reversed(TABLES):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(batch_op.f(f"fk_{table}_project_id_projects"), type_="foreignkey")
            batch_op.drop_index(batch_op.f(f"ix_{table}_project_id"))
            batch_op.drop_column("project_id")
    op.drop_table("api_keys")
    op.drop_table("projects")
