"""runs.agent_gateway: where a running agent run's gateway listens ({url, token}), written by the worker
that holds the run and read by the API, which proxies agents' episode, chat and reward calls to it.

Revision ID: f1b3d5e7a9c2
Revises: e7a9c1d3f5b6
Create Date: 2026-12-06 18:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "f1b3d5e7a9c2"
down_revision: str | Sequence[str] | None = "e7a9c1d3f5b6"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "agent_gateway", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("agent_gateway")
