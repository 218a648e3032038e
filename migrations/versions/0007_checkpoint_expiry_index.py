"""an index on checkpoints.expires_at: the reaper's sweep read every checkpoint row

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 03:30:00.000000
"""

from alembic import op


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoints_expires_at'), ['expires_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_expires_at'))
