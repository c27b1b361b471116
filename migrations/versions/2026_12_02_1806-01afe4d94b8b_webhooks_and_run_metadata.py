"""Webhooks and their delivery log; runs get user metadata and an `announced` flag.

Runs that had already finished are marked announced: webhooks fire only for runs that end from now on.

Revision ID: 01afe4d94b8b
Revises: a96fa9f29bb6
Create Date: 2026-12-02 18:06:07.947188
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '01afe4d94b8b'
down_revision: str | Sequence[str] | None = 'a96fa9f29bb6'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('webhooks',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('project_id', sa.Uuid(), nullable=False),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('description', sa.String(length=200), nullable=True),
    sa.Column('event_types', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('secret', sa.String(length=100), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_webhooks_project_id_projects'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhooks'))
    )
    with op.batch_alter_table('webhooks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_webhooks_project_id'), ['project_id'], unique=False)

    op.create_table('webhook_deliveries',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('webhook_id', sa.Uuid(), nullable=False),
    sa.Column('run_id', sa.Uuid(), nullable=False),
    sa.Column('event_type', sa.String(length=32), nullable=False),
    sa.Column('message_id', sa.String(length=64), nullable=False),
    sa.Column('body', sa.Text(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('pending', 'succeeded', 'failed')", name=op.f('ck_webhook_deliveries_status')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_webhook_deliveries_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['webhook_id'], ['webhooks.id'], name=op.f('fk_webhook_deliveries_webhook_id_webhooks'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_deliveries'))
    )
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.create_index('ix_webhook_deliveries_due', ['status', 'next_attempt_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_webhook_deliveries_run_id'), ['run_id'], unique=False)
        batch_op.create_index('ix_webhook_deliveries_webhook_id_created_at', ['webhook_id', 'created_at'], unique=False)

    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('metadata', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True))
        batch_op.add_column(sa.Column('announced', sa.Boolean(), server_default=sa.false(), nullable=False))
        batch_op.create_index('ix_runs_unannounced', ['finished_at'], unique=False, postgresql_where=sa.text('announced = false AND finished_at IS NOT NULL'), sqlite_where=sa.text('announced = 0 AND finished_at IS NOT NULL'))

    runs = sa.table("runs", sa.column("announced", sa.Boolean()), sa.column("finished_at", sa.DateTime()))
    op.execute(sa.update(runs).where(runs.c.finished_at.is_not(None)).values(announced=True))


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index('ix_runs_unannounced', postgresql_where=sa.text('announced = false AND finished_at IS NOT NULL'), sqlite_where=sa.text('announced = 0 AND finished_at IS NOT NULL'))
        batch_op.drop_column('announced')
        batch_op.drop_column('metadata')

    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.drop_index('ix_webhook_deliveries_webhook_id_created_at')
        batch_op.drop_index(batch_op.f('ix_webhook_deliveries_run_id'))
        batch_op.drop_index('ix_webhook_deliveries_due')

    op.drop_table('webhook_deliveries')
    with op.batch_alter_table('webhooks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_webhooks_project_id'))

    op.drop_table('webhooks')
