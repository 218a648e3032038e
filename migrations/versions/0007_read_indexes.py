"""indexes for reads that went through every row of a growing table

The reaper's sweep by checkpoints.expires_at; a run's or sampling session's futures by
(tenant, model_id, state); a session listing's counts by training_runs.session_id and
sampling_sessions.session_id; a run's sampling sessions by (tenant, run_id); a run's
checkpoints by (tenant, run_id), which replaces the index of checkpoints.tenant alone.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 03:30:00.000000
"""

from alembic import op


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

INDEXES = [
    ('checkpoints', ['expires_at']),
    ('futures', ['tenant', 'model_id', 'state']),
    ('training_runs', ['session_id']),
    ('sampling_sessions', ['session_id']),
    ('sampling_sessions', ['tenant', 'run_id']),
]


def upgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_tenant'))
        batch_op.create_index(batch_op.f('ix_checkpoints_tenant_run_id'), ['tenant', 'run_id'], unique=False)
    for table, columns in INDEXES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.create_index(batch_op.f(f"ix_{table}_{'_'.join(columns)}"), columns, unique=False)


def downgrade() -> None:
    for table, columns in reversed(INDEXES):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(batch_op.f(f"ix_{table}_{'_'.join(columns)}"))
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_tenant_run_id'))
        batch_op.create_index(batch_op.f('ix_checkpoints_tenant'), ['tenant'], unique=False)
