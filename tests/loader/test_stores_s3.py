"""S3 store against a real moto server over HTTP (and a faulty proxy in front of it)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import boto3
import pytest

from ember.errors import ObjectChanged, StoreUnavailable
from ember.loader.stores import S3Store, open_store
from tests.loader.conftest import FaultyProxy, s3_settings, upload

pytestmark = pytest.mark.s3


@pytest.fixture
def blob(tmp_path: Path) -> bytes:
    data = hashlib.sha256(b"seed").digest() * (12 * 1024 * 1024 // 32 + 7)  # ~12 MiB
    (tmp_path / "blob.bin").write_bytes(data)
    return data


def test_parallel_ranged_gets_yield_parts_in_order(
    tmp_path: Path, faulty_proxy: FaultyProxy, bucket: str, blob: bytes
) -> None:
    uri = upload(faulty_proxy.upstream, bucket, "blob.bin", tmp_path / "blob.bin")
    settings = s3_settings(tmp_path, faulty_proxy.url, s3_max_concurrency=4)
    store = open_store(uri, settings)
    info = store.stat(uri)
    parts = list(store.iter_parts(uri, info))
    assert [off for off, _ in parts] == list(range(0, len(blob), 5 * 1024 * 1024))
    assert b"".join(p for _, p in parts) == blob
    assert faulty_proxy.gets == len(parts) == 3
    digest, _ = store.sha256(uri)
    assert digest == hashlib.sha256(blob).hexdigest()


def test_throttling_5xx_and_cut_bodies_are_retried(
    tmp_path: Path, faulty_proxy: FaultyProxy, bucket: str, blob: bytes
) -> None:
    uri = upload(faulty_proxy.upstream, bucket, "blob.bin", tmp_path / "blob.bin")
    store = open_store(uri, s3_settings(tmp_path, faulty_proxy.url, s3_max_concurrency=2))
    info = store.stat(uri)
    faulty_proxy.faults = ["503", "500", "cut", "503"]
    data = b"".join(p for _, p in store.iter_parts(uri, info))
    assert data == blob
    assert faulty_proxy.gets == 3 + 4  # every fault cost exactly one extra request


def test_gives_up_after_max_attempts(
    tmp_path: Path, faulty_proxy: FaultyProxy, bucket: str, blob: bytes
) -> None:
    uri = upload(faulty_proxy.upstream, bucket, "blob.bin", tmp_path / "blob.bin")
    store = open_store(uri, s3_settings(tmp_path, faulty_proxy.url, s3_max_attempts=3))
    faulty_proxy.faults = ["503"] * 3
    with pytest.raises(StoreUnavailable, match="gave up after 3 attempts"):
        store.read_range(uri, 0, 1024)
    assert faulty_proxy.gets == 3


def test_backoff_is_capped_exponential_with_jitter(tmp_path: Path, moto_endpoint: str) -> None:
    store = S3Store(s3_settings(tmp_path, moto_endpoint), {"*"})
    for attempt in range(8):
        cap = min(0.05, 0.01 * 2**attempt)
        samples = [store.retry.backoff_s(attempt) for _ in range(200)]
        assert all(0 <= s <= cap for s in samples)
        assert max(samples) > cap / 2  # jittered over the whole range, not fixed


def test_changed_object_is_never_mixed(
    tmp_path: Path, moto_endpoint: str, bucket: str, blob: bytes
) -> None:
    uri = upload(moto_endpoint, bucket, "blob.bin", tmp_path / "blob.bin")
    store = open_store(uri, s3_settings(tmp_path, moto_endpoint))
    info = store.stat(uri)
    parts = store.iter_parts(uri, info, part_bytes=5 * 1024 * 1024, concurrency=1)
    next(parts)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    s3.put_object(Bucket=bucket, Key="blob.bin", Body=b"x" * len(blob))
    with pytest.raises(ObjectChanged):
        next(parts)
