"""run cancellation, per-step metrics, sampling sessions linked to their run

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 02:59:13.336132
"""

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('run_steps',
    sa.Column('model_id', sa.String(length=200), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('tokens', sa.BigInteger(), nullable=False),
    sa.Column('forward_backward', sa.Integer(), nullable=False),
    sa.Column('learning_rate', sa.Float(), nullable=True),
    sa.Column('grad_norm', sa.Float(), nullable=True),
    sa.Column('metrics', sa.JSON(), nullable=True),
    sa.Column('first_request_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('model_id', 'step', name=op.f('pk_run_steps'))
    )
    with op.batch_alter_table('run_steps', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_run_steps_tenant'), ['tenant'], unique=False)

    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('run_id', sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column('closed_at', sa.DateTime(timezone=True), nullable=True))

    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('cancelled_at', sa.DateTime(timezone=True), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.drop_column('cancelled_at')

    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.drop_column('closed_at')
        batch_op.drop_column('run_id')

    with op.batch_alter_table('run_steps', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_steps_tenant'))

    op.drop_table('run_steps')
