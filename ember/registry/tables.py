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


class VersionStatus(enum.StrEnum):
    pending = "pending"
    ready = "ready"
    failed = "failed"


class Tenant(SQLModel, table=True):
    __tablename__ = "tenants"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True, max_length=63)
    created_at: datetime = Field(default_factory=utcnow)


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
