"""Suite-wide fixtures: a clean environment, per-test settings, and the real services."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.config import Settings, get_settings
from tests import services


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No EMBER_* leaks in from the caller's shell or from another test."""
    for key in list(os.environ):
        if key.startswith("EMBER_"):
            monkeypatch.delenv(key)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "ember-data"
    path.mkdir()
    return path


@pytest.fixture
def settings(data_dir: Path) -> Settings:
    return Settings(data_dir=data_dir)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """URL of a real S3-compatible HTTP server (moto) for the whole session."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with services.moto_server() as url:
        yield url


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    with services.postgres_server() as url:
        yield url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with services.redis_server() as url:
        yield url
