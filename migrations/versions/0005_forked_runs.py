"""forked runs: parent and step

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 03:23:24.365759
"""

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('forked_from_run', sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column('forked_from_step', sa.Integer(), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.drop_column('forked_from_step')
        batch_op.drop_column('forked_from_run')

