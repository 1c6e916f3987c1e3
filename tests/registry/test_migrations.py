"""Alembic migrations match the SQLModel tables, on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlmodel import SQLModel

from ember.registry.db import make_engine, migrate
from tests import services


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'r.db'}"
    return services.fresh_postgres_database(request.getfixturevalue("postgres_url"))


def test_migrations_build_exactly_the_declared_schema(url: str) -> None:
    engine = make_engine(url)
    migrate(engine)
    migrate(engine)  # idempotent: a second start changes nothing
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    assert diff == []
    tables = set(inspect(engine).get_table_names())
    assert {"tenants", "api_keys", "models", "model_versions", "deployments",
            "deployment_revisions", "alembic_version"} <= tables  # fmt: skip


def test_sizes_beyond_32_bits_are_stored(url: str) -> None:
    from sqlmodel import Session

    from ember.registry.tables import Model, ModelVersion, Tenant

    engine = make_engine(url)
    migrate(engine)
    with Session(engine) as session:
        tenant = Tenant(name="t")
        session.add(tenant)
        session.flush()
        model = Model(tenant_id=tenant.id or 0, name="m")
        session.add(model)
        session.flush()
        version = ModelVersion(model_id=model.id or 0, version="1", artifact_uri="file:///x",
                               engine="torch", size_bytes=70 * 1024**3)  # fmt: skip
        session.add(version)
        session.commit()
        assert session.get(ModelVersion, version.id).size_bytes == 70 * 1024**3
