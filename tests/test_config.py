"""Settings: embedded defaults, EMBER_* overrides, and loud refusal of bad values."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from ember.config import Settings


def test_embedded_defaults_live_under_the_data_dir(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    assert s.registry_url == f"sqlite:///{tmp_path / 'registry.db'}"
    assert s.store_url == (tmp_path / "objects").as_uri()
    assert s.weight_cache_dir == tmp_path / "cache"
    assert s.allowed_file_roots == [tmp_path / "objects"]
    assert s.allowed_buckets == set()
    assert (s.host, s.port) == ("127.0.0.1", 8000)


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBER_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("EMBER_PORT", "9001")
    monkeypatch.setenv("EMBER_OBJECT_STORE_URL", "s3://models/prefix")
    monkeypatch.setenv("EMBER_S3_ALLOWED_BUCKETS", "extra-a, extra-b")
    monkeypatch.setenv("EMBER_FILE_ROOTS", f"{tmp_path}/a,{tmp_path}/b")
    s = Settings()
    assert s.port == 9001 and s.data_dir == tmp_path
    assert s.allowed_buckets == {"models", "extra-a", "extra-b"}
    assert s.allowed_file_roots == [tmp_path / "a", tmp_path / "b"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("EMBER_PORT", "0"),
        ("EMBER_PORT", "http"),
        ("EMBER_ADMIN_KEY", "changethis"),
        ("EMBER_ADMIN_KEY", "short"),
        ("EMBER_OBJECT_STORE_URL", "ftp://x/y"),
        ("EMBER_OBJECT_STORE_URL", "s3:///nobucket"),
        ("EMBER_LOG_LEVEL", "LOUD"),
        ("EMBER_CACHE_MAX_BYTES", "-1"),
    ],
)
def test_bad_values_are_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, key: str, value: str
) -> None:
    monkeypatch.setenv(key, value)
    with pytest.raises(ValidationError, match=key.removeprefix("EMBER_").lower()):
        Settings()


def test_unknown_ember_variables_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.config import get_settings

    monkeypatch.setenv("EMBER_PROT", "9000")
    with pytest.raises(ValueError, match=r"EMBER_PROT.*did you mean EMBER_PORT"):
        get_settings()
    monkeypatch.delenv("EMBER_PROT")
    monkeypatch.setenv("EMBER_API_KEY", "client-side")
    assert get_settings().port == 8000


def test_a_data_dir_with_a_space_is_its_own_file_root(tmp_path: Path) -> None:
    """The object store's URI is quoted (``as_uri``); its file root is the decoded path."""
    settings = Settings(data_dir=tmp_path / "my data")
    assert settings.allowed_file_roots[0] == (tmp_path / "my data" / "objects").resolve()
