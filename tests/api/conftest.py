"""A real Ember API (uvicorn on loopback) over a real registry: SQLite or PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from ember.api.app import create_app
from ember.config import Settings
from tests import services

ADMIN_KEY = "ek_test-admin-key-0123456789abcdef"
#: A torch engine config that names a real factory (the MLP example).
MLP = {"factory": "ember.engine.examples.mlp:mlp"}


@dataclass
class Api:
    url: str
    admin: httpx.Client
    settings: Settings

    def client(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def tenant_client(self, tenant: str) -> httpx.Client:
        """A client holding a fresh tenant key for ``tenant`` (created if needed)."""
        self.admin.post("/v1/tenants", json={"name": tenant})
        created = self.admin.post("/v1/keys", json={"name": "t", "tenant": tenant})
        assert created.status_code == 201, created.text
        return self.client(created.json()["key"])


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def registry_url(request: pytest.FixtureRequest, data_dir: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{data_dir / 'registry.db'}"
    server: str = request.getfixturevalue("postgres_url")
    return services.fresh_postgres_database(server)


@pytest.fixture
def store_dir(data_dir: Path) -> Path:
    path = data_dir / "objects"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture
def api_settings(data_dir: Path, registry_url: str, store_dir: Path) -> Settings:
    return Settings(
        data_dir=data_dir,
        database_url=registry_url,
        admin_key=ADMIN_KEY,  # type: ignore[arg-type]
        validate_inline_max_bytes=1024 * 1024,
        max_request_bytes=256 * 1024,
        pools_enabled=False,
    )


@pytest.fixture
def api(api_settings: Settings) -> Iterator[Api]:
    with (
        services.serve_app(create_app(api_settings)) as url,
        httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
        ) as admin,
    ):
        yield Api(url, admin, api_settings)
