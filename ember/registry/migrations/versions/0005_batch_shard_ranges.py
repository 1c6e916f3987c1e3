"""batch shards: the planned input's etag and a JSONL shard's byte range and first line

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("batch_shards", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("input_etag", sqlmodel.sql.sqltypes.AutoString(length=256), nullable=True)
        )
        batch_op.add_column(sa.Column("byte_start", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("byte_end", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("line_start", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batch_shards", schema=None) as batch_op:
        batch_op.drop_column("line_start")
        batch_op.drop_column("byte_end")
        batch_op.drop_column("byte_start")
        batch_op.drop_column("input_etag")
