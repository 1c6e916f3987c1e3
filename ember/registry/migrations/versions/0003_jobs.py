"""async jobs: jobs, their attempts, per-tenant webhook secrets

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

String = sqlmodel.sql.sqltypes.AutoString
Time = sqlmodel.sql.sqltypes.UTCDateTime


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("uid", String(length=40), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("model", String(length=63), nullable=False),
        sa.Column("version_ref", String(length=63), nullable=True),
        sa.Column("version_pinned", String(length=63), nullable=True),
        sa.Column("deployment", String(length=63), nullable=False),
        sa.Column("version", String(length=63), nullable=True),
        sa.Column("rung", String(length=16), nullable=True),
        sa.Column("status", String(length=16), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("instances", sa.Integer(), nullable=False),
        sa.Column("units", sa.Float(), nullable=False),
        sa.Column("chunk_size", sa.Integer(), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=True),
        sa.Column("input_uri", String(length=2048), nullable=True),
        sa.Column("input_etag", String(length=256), nullable=True),
        sa.Column("input_bytes", sa.BigInteger(), nullable=True),
        sa.Column("request_sha256", String(length=64), nullable=False),
        sa.Column("idempotency_key", String(length=255), nullable=True),
        sa.Column("webhook_url", String(length=2048), nullable=True),
        sa.Column("webhook_status", String(length=16), nullable=True),
        sa.Column("webhook_attempts", sa.Integer(), nullable=False),
        sa.Column("webhook_error", String(length=1000), nullable=True),
        sa.Column("webhook_next_at", Time(), nullable=True),
        sa.Column("webhook_delivered_at", Time(), nullable=True),
        sa.Column("attempt_count", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("deferrals", sa.Integer(), nullable=False),
        sa.Column("runs", sa.Integer(), nullable=False),
        sa.Column("lease", String(length=64), nullable=True),
        sa.Column("lease_expires_at", Time(), nullable=True),
        sa.Column("not_before", Time(), nullable=True),
        sa.Column("published_at", Time(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("result_uri", String(length=2048), nullable=True),
        sa.Column("result_sha256", String(length=64), nullable=True),
        sa.Column("result_bytes", sa.BigInteger(), nullable=True),
        sa.Column("error", String(length=2000), nullable=True),
        sa.Column("error_code", String(length=64), nullable=True),
        sa.Column("created_at", Time(), nullable=False),
        sa.Column("updated_at", Time(), nullable=False),
        sa.Column("started_at", Time(), nullable=True),
        sa.Column("finished_at", Time(), nullable=True),
        sa.Column("expires_at", Time(), nullable=True),
        sa.Column("purged_at", Time(), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "idempotency_key"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_tenant_id"), ["tenant_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_uid"), ["uid"], unique=True)

    op.create_table(
        "webhook_secrets",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("secret", String(length=128), nullable=False),
        sa.Column("created_at", Time(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.PrimaryKeyConstraint("tenant_id"),
    )
    op.create_table(
        "job_attempts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("lease", String(length=64), nullable=False),
        sa.Column("worker", String(length=255), nullable=False),
        sa.Column("started_at", Time(), nullable=False),
        sa.Column("finished_at", Time(), nullable=True),
        sa.Column("outcome", String(length=16), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", String(length=2000), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "number"),
    )
    with op.batch_alter_table("job_attempts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_job_attempts_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("job_attempts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_job_attempts_job_id"))
    op.drop_table("job_attempts")
    op.drop_table("webhook_secrets")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_uid"))
        batch_op.drop_index(batch_op.f("ix_jobs_tenant_id"))
        batch_op.drop_index(batch_op.f("ix_jobs_status"))
    op.drop_table("jobs")
