"""Registry tables. Wire schemas live in ``schemas.py``; queries in the per-entity modules."""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, UniqueConstraint
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    return datetime.now(UTC)


class KeyScope(enum.StrEnum):
    admin = "admin"
    tenant = "tenant"
    worker = "worker"
    """The job and batch workers' scope: acts for each job's tenant (``X-Ember-Tenant``) on
    the data plane and the lanes it needs (``:batch-lane``), nothing on the control plane."""


class VersionStatus(enum.StrEnum):
    pending = "pending"
    ready = "ready"
    failed = "failed"


class Tenant(SQLModel, table=True):
    __tablename__ = "tenants"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True, max_length=63)
    created_at: datetime = Field(default_factory=utcnow)
    trusted: bool = False
    """Marked by an admin: the tenant may name engine factories beyond
    ``EMBER_ENGINE_FACTORIES`` (its code is then the operator's responsibility)."""
    quotas: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    """Per-tenant overrides of the ``EMBER_QUOTA_*`` defaults (quota name -> limit), set
    by an admin; null: the defaults."""


class ApiKey(SQLModel, table=True):
    __tablename__ = "api_keys"

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    name: str = Field(max_length=63)
    scope: KeyScope
    prefix: str = Field(max_length=16)
    """First characters of the key, shown in listings so a person can tell keys apart."""
    key_hash: str = Field(index=True, unique=True, max_length=64)
    """sha256 of the whole key (keys are 256-bit random, so a fast hash is enough);
    the key itself is never stored."""
    created_at: datetime = Field(default_factory=utcnow)
    revoked_at: datetime | None = None


class Model(SQLModel, table=True):
    __tablename__ = "models"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    name: str = Field(max_length=63)
    description: str = Field(default="", max_length=1000)
    created_at: datetime = Field(default_factory=utcnow)


class ModelVersion(SQLModel, table=True):
    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("model_id", "version"),)

    id: int | None = Field(default=None, primary_key=True)
    model_id: int = Field(foreign_key="models.id", index=True)
    version: str = Field(max_length=63)
    artifact_uri: str = Field(max_length=2048)
    engine: str = Field(max_length=32)
    engine_config: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    input_schema: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    output_schema: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    status: VersionStatus = VersionStatus.pending
    status_reason: str | None = Field(default=None, max_length=2000)
    expected_sha256: str | None = Field(default=None, max_length=64)
    """The digest the client supplied, checked during validation."""
    sha256: str | None = Field(default=None, max_length=64)
    """The artifact's digest; for a directory version the digest of its manifest
    (``ember.domain.manifest``)."""
    files: list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSON))
    """The version's files, ``{path, size, sha256}`` each, recorded at validation: a
    directory version's every file; a single-file version's weights and the sidecars found
    beside it (config, tokenizer). None: registered before manifests (sidecars unverified)."""
    size_bytes: int | None = Field(default=None, sa_type=BigInteger)
    tensor_count: int | None = None
    etag: str | None = Field(default=None, max_length=256)
    cost_models: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    """hardware key -> calibrated ``CostModel`` fields (measured, so not part of the
    immutable version content)."""
    created_at: datetime = Field(default_factory=utcnow)
    validated_at: datetime | None = None


class Deployment(SQLModel, table=True):
    __tablename__ = "deployments"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    name: str = Field(max_length=63)
    model_id: int = Field(foreign_key="models.id", index=True)
    traffic: dict[str, int] = Field(default_factory=dict, sa_column=Column(JSON))
    """version -> weight (percent; sums to 100)."""
    aliases: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON))
    """alias (production, canary, ...) -> version."""
    policy: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    """Pool policy (validated by ``schemas.PoolPolicy``)."""
    fallback: list[str] = Field(default_factory=list, sa_column=Column(JSON))
    """Fallback chain: versions of this model (or ``deployment:NAME``), tried in order."""
    revision: int = 1
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)


class DeploymentRevision(SQLModel, table=True):
    """Every routing change (create, promote, canary, rollback) — rollback walks these."""

    __tablename__ = "deployment_revisions"
    __table_args__ = (UniqueConstraint("deployment_id", "revision"),)

    id: int | None = Field(default=None, primary_key=True)
    deployment_id: int = Field(foreign_key="deployments.id", index=True)
    revision: int
    traffic: dict[str, int] = Field(default_factory=dict, sa_column=Column(JSON))
    aliases: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON))
    reason: str = Field(max_length=200)
    created_at: datetime = Field(default_factory=utcnow)


# --- async jobs (ember/jobs) ---------------------------------------------------------------


class JobStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


class Job(SQLModel, table=True):
    """One async job. The row is the source of truth; the broker only delivers its id.

    ``lease`` fences every write a worker makes: a worker claims the job by setting a
    fresh lease token (conditional UPDATE) and writes the result only ``WHERE lease = its
    token``, so a redelivered or zombie attempt can never write a second result."""

    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("tenant_id", "idempotency_key"),)

    id: int | None = Field(default=None, primary_key=True)
    uid: str = Field(index=True, unique=True, max_length=40)
    """The public job id (``job_...``)."""
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    model: str = Field(max_length=63)
    version_ref: str | None = Field(default=None, max_length=63)
    """The version or alias the client asked for (None: the deployment's traffic split)."""
    version_pinned: str | None = Field(default=None, max_length=63)
    """``version_ref`` resolved at submit (an alias becomes its version)."""
    deployment: str = Field(max_length=63)
    version: str | None = Field(default=None, max_length=63)
    """The version that ran it."""
    rung: str | None = Field(default=None, max_length=16)
    status: str = Field(default=JobStatus.queued, max_length=16, index=True)
    priority: int = 5
    instances: int = 0
    units: float = 0.0
    chunk_size: int = 1
    inputs: list[Any] | None = Field(default=None, sa_column=Column(JSON))
    input_uri: str | None = Field(default=None, max_length=2048)
    input_etag: str | None = Field(default=None, max_length=256)
    input_bytes: int | None = Field(default=None, sa_type=BigInteger)
    request_sha256: str = Field(max_length=64)
    idempotency_key: str | None = Field(default=None, max_length=255)
    webhook_url: str | None = Field(default=None, max_length=2048)
    webhook_status: str | None = Field(default=None, max_length=16)
    webhook_attempts: int = 0
    webhook_error: str | None = Field(default=None, max_length=1000)
    webhook_next_at: datetime | None = None
    webhook_delivered_at: datetime | None = None
    attempt_count: int = 0
    """Attempts that count toward ``max_attempts`` (a deferral on 429 does not)."""
    max_attempts: int = 5
    deferrals: int = 0
    runs: int = 0
    """Every claim (attempts and deferrals): numbers the ``job_attempts`` rows."""
    lease: str | None = Field(default=None, max_length=64)
    lease_expires_at: datetime | None = None
    not_before: datetime | None = None
    published_at: datetime | None = None
    result: list[Any] | None = Field(default=None, sa_column=Column(JSON))
    result_uri: str | None = Field(default=None, max_length=2048)
    result_sha256: str | None = Field(default=None, max_length=64)
    result_bytes: int | None = Field(default=None, sa_type=BigInteger)
    error: str | None = Field(default=None, max_length=2000)
    error_code: str | None = Field(default=None, max_length=64)
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    expires_at: datetime | None = None
    purged_at: datetime | None = None


class JobAttempt(SQLModel, table=True):
    """One run of a job by a worker, with how it ended."""

    __tablename__ = "job_attempts"
    __table_args__ = (UniqueConstraint("job_id", "number"),)

    id: int | None = Field(default=None, primary_key=True)
    job_id: int = Field(foreign_key="jobs.id", index=True)
    number: int
    lease: str = Field(max_length=64)
    worker: str = Field(max_length=255)
    started_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime | None = None
    outcome: str = Field(default="running", max_length=16)
    """running | succeeded | failed | deferred | lost | cancelled | superseded"""
    status_code: int | None = None
    error: str | None = Field(default=None, max_length=2000)


class WebhookSecret(SQLModel, table=True):
    """A tenant's webhook signing secret (HMAC-SHA256); kept in clear because signing
    needs it, readable only by the tenant's keys."""

    __tablename__ = "webhook_secrets"

    tenant_id: int = Field(foreign_key="tenants.id", primary_key=True)
    secret: str = Field(max_length=128)
    created_at: datetime = Field(default_factory=utcnow)


# --- batch scoring (ember/batch) -----------------------------------------------------------


class BatchSchedule(SQLModel, table=True):
    """A cron schedule that scores a dataset (``ember.batch``)."""

    __tablename__ = "batch_schedules"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    name: str = Field(max_length=63)
    cron: str = Field(max_length=255)
    timezone: str = Field(max_length=64)
    spec: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    """The run spec (model, input/output URIs, shard size, ...): ``ember.batch.schemas``."""
    catch_up: str = Field(default="latest", max_length=16)
    paused: bool = False
    next_fire_at: datetime | None = Field(default=None, index=True)
    """The next fire time (UTC) not yet handled by a beat."""
    last_fired_at: datetime | None = None
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)


class BatchRun(SQLModel, table=True):
    """One run of a batch spec; ``fire_key`` (schedule + fire time) is unique, so two
    beats can never start the same scheduled run twice."""

    __tablename__ = "batch_runs"

    id: int | None = Field(default=None, primary_key=True)
    uid: str = Field(index=True, unique=True, max_length=40)
    tenant_id: int = Field(foreign_key="tenants.id", index=True)
    schedule_id: int | None = Field(default=None, foreign_key="batch_schedules.id", index=True)
    fire_key: str | None = Field(default=None, unique=True, max_length=128)
    fire_at: datetime | None = None
    spec: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    model: str = Field(max_length=63)
    deployment: str = Field(max_length=63)
    version: str = Field(max_length=63)
    """Resolved once when the run starts; every shard scores on it."""
    artifact_sha256: str = Field(default="", max_length=64)
    input_uri: str = Field(max_length=2048)
    output_uri: str = Field(max_length=2048)
    status: str = Field(default="running", max_length=16, index=True)
    shards_total: int = 0
    rows_total: int = 0
    error: str | None = Field(default=None, max_length=2000)
    deadline_at: datetime | None = None
    created_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None


class BatchShard(SQLModel, table=True):
    """A slice of a run's input; committed at most once (fenced on ``lease``)."""

    __tablename__ = "batch_shards"
    __table_args__ = (UniqueConstraint("run_id", "number"),)

    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="batch_runs.id", index=True)
    number: int
    input_uri: str = Field(max_length=2048)
    row_start: int
    row_end: int
    input_etag: str | None = Field(default=None, max_length=256)
    """The input object's etag when the run was planned: a shard refuses to read it changed."""
    byte_start: int | None = Field(default=None, sa_type=BigInteger)
    byte_end: int | None = Field(default=None, sa_type=BigInteger)
    """A JSONL shard's lines as bytes ``[byte_start, byte_end)`` of the object (from the
    planning's line index): its worker reads just those. None: the whole object."""
    line_start: int | None = Field(default=None, sa_type=BigInteger)
    """The file's line number (from 1) at ``byte_start``, for the rejects' reasons."""
    status: str = Field(default="queued", max_length=16, index=True)
    """queued | running | committed | failed"""
    attempts: int = 0
    lease: str | None = Field(default=None, max_length=64)
    lease_expires_at: datetime | None = None
    published_at: datetime | None = None
    rows_scored: int = 0
    rows_rejected: int = 0
    output_uri: str | None = Field(default=None, max_length=2048)
    rejects_uri: str | None = Field(default=None, max_length=2048)
    error: str | None = Field(default=None, max_length=2000)
    updated_at: datetime = Field(default_factory=utcnow)
    committed_at: datetime | None = None
