"""timeslicer leases on events, lease fences, a full run's sampler weights

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 21:40:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('lease_id', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('fenced', sa.Boolean(), nullable=True))
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('weights', sa.JSON(), nullable=True))
    op.create_table(
        'lease_fences',
        sa.Column('tenant', sa.String(length=64), nullable=False),
        sa.Column('key', sa.String(length=200), nullable=False),
        sa.Column('lease_id', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('tenant', 'key', name=op.f('pk_lease_fences')),
    )


def downgrade() -> None:
    op.drop_table('lease_fences')
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.drop_column('weights')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_column('fenced')
        batch_op.drop_column('lease_id')
