"""batch scoring: schedules, runs and their shards

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

String = sqlmodel.sql.sqltypes.AutoString
Time = sqlmodel.sql.sqltypes.UTCDateTime


def upgrade() -> None:
    op.create_table(
        "batch_schedules",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", String(length=63), nullable=False),
        sa.Column("cron", String(length=255), nullable=False),
        sa.Column("timezone", String(length=64), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=True),
        sa.Column("catch_up", String(length=16), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("next_fire_at", Time(), nullable=True),
        sa.Column("last_fired_at", Time(), nullable=True),
        sa.Column("created_at", Time(), nullable=False),
        sa.Column("updated_at", Time(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "name"),
    )
    op.create_index("ix_batch_schedules_tenant_id", "batch_schedules", ["tenant_id"])
    op.create_index("ix_batch_schedules_next_fire_at", "batch_schedules", ["next_fire_at"])
    op.create_table(
        "batch_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("uid", String(length=40), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("schedule_id", sa.Integer(), nullable=True),
        sa.Column("fire_key", String(length=128), nullable=True),
        sa.Column("fire_at", Time(), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=True),
        sa.Column("model", String(length=63), nullable=False),
        sa.Column("deployment", String(length=63), nullable=False),
        sa.Column("version", String(length=63), nullable=False),
        sa.Column("artifact_sha256", String(length=64), nullable=False),
        sa.Column("input_uri", String(length=2048), nullable=False),
        sa.Column("output_uri", String(length=2048), nullable=False),
        sa.Column("status", String(length=16), nullable=False),
        sa.Column("shards_total", sa.Integer(), nullable=False),
        sa.Column("rows_total", sa.Integer(), nullable=False),
        sa.Column("error", String(length=2000), nullable=True),
        sa.Column("deadline_at", Time(), nullable=True),
        sa.Column("created_at", Time(), nullable=False),
        sa.Column("started_at", Time(), nullable=True),
        sa.Column("finished_at", Time(), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.ForeignKeyConstraint(["schedule_id"], ["batch_schedules.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("fire_key"),
    )
    op.create_index("ix_batch_runs_uid", "batch_runs", ["uid"], unique=True)
    op.create_index("ix_batch_runs_tenant_id", "batch_runs", ["tenant_id"])
    op.create_index("ix_batch_runs_schedule_id", "batch_runs", ["schedule_id"])
    op.create_index("ix_batch_runs_status", "batch_runs", ["status"])
    op.create_table(
        "batch_shards",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("input_uri", String(length=2048), nullable=False),
        sa.Column("row_start", sa.Integer(), nullable=False),
        sa.Column("row_end", sa.Integer(), nullable=False),
        sa.Column("status", String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease", String(length=64), nullable=True),
        sa.Column("lease_expires_at", Time(), nullable=True),
        sa.Column("published_at", Time(), nullable=True),
        sa.Column("rows_scored", sa.Integer(), nullable=False),
        sa.Column("rows_rejected", sa.Integer(), nullable=False),
        sa.Column("output_uri", String(length=2048), nullable=True),
        sa.Column("rejects_uri", String(length=2048), nullable=True),
        sa.Column("error", String(length=2000), nullable=True),
        sa.Column("updated_at", Time(), nullable=False),
        sa.Column("committed_at", Time(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["batch_runs.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "number"),
    )
    op.create_index("ix_batch_shards_run_id", "batch_shards", ["run_id"])
    op.create_index("ix_batch_shards_status", "batch_shards", ["status"])


def downgrade() -> None:
    op.drop_table("batch_shards")
    op.drop_table("batch_runs")
    op.drop_table("batch_schedules")
