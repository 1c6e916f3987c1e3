"""tenants: trusted flag and quota overrides; api keys: the worker scope

Revision ID: 0006
Revises: 0005
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("trusted", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.add_column(sa.Column("quotas", sa.JSON(), nullable=True))
    if op.get_context().dialect.name == "postgresql":
        # A native enum: the new value is added in place (SQLite stores the name as text).
        op.execute("ALTER TYPE keyscope ADD VALUE IF NOT EXISTS 'worker'")


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("quotas")
        batch_op.drop_column("trusted")
