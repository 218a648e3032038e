"""billing usage: futures carry a sample's prompt and sampled tokens, read by completion
time; removed checkpoints keep their stored interval

Futures stored before this revision have no prefill or sampled tokens (billing counts their
sampling as zero) until a replay (`openrl replay`) rebuilds the projections from the events;
likewise checkpoints removed before it have no interval until a replay.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-10 09:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('futures', schema=None) as batch_op:
        batch_op.add_column(sa.Column('prefill_tokens', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('sampled_tokens', sa.BigInteger(), nullable=True))
        batch_op.create_index(
            batch_op.f('ix_futures_tenant_kind_completed_at'), ['tenant', 'kind', 'completed_at'], unique=False
        )
    op.create_table(
        'removed_checkpoints',
        sa.Column('removed_by', sa.String(length=64), nullable=False),
        sa.Column('tenant', sa.String(length=64), nullable=False),
        sa.Column('run_id', sa.String(length=200), nullable=False),
        sa.Column('checkpoint_id', sa.String(length=300), nullable=False),
        sa.Column('saved_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('removed_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('size_bytes', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('removed_by', name=op.f('pk_removed_checkpoints')),
    )
    with op.batch_alter_table('removed_checkpoints', schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f('ix_removed_checkpoints_tenant_removed_at'), ['tenant', 'removed_at'], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table('removed_checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_removed_checkpoints_tenant_removed_at'))
    op.drop_table('removed_checkpoints')
    with op.batch_alter_table('futures', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_futures_tenant_kind_completed_at'))
        batch_op.drop_column('sampled_tokens')
        batch_op.drop_column('prefill_tokens')
