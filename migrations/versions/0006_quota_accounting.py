"""quota accounting: futures carry the tokens they are charged; indexes for the quota reads

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 10:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('futures', schema=None) as batch_op:
        batch_op.add_column(sa.Column('tokens', sa.BigInteger(), nullable=True))
        batch_op.create_index(batch_op.f('ix_futures_tenant_state'), ['tenant', 'state'], unique=False)
        batch_op.create_index(batch_op.f('ix_futures_tenant_created_at'), ['tenant', 'created_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('futures', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_futures_tenant_created_at'))
        batch_op.drop_index(batch_op.f('ix_futures_tenant_state'))
        batch_op.drop_column('tokens')
