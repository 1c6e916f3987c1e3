"""object store (moto over HTTP) -> cache -> tensors, across threads and processes."""

from __future__ import annotations

import hashlib
import multiprocessing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ember.config import Settings
from ember.loader.load import WeightLoader
from tests.loader.conftest import FaultyProxy, assert_same, s3_settings, upload, write_artifact

pytestmark = pytest.mark.s3


def _digest_tensors(tensors: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].reshape(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def _child(settings: dict[str, Any], uri: str, sha: str, start: Any, out: Any) -> None:
    loaded = WeightLoader(Settings(**settings)).load("m", "1", uri, sha)
    start.wait(60)
    out.put((loaded.report.cache, loaded.report.bytes_fetched, _digest_tensors(loaded.tensors)))


def _object_bytes(proxy: FaultyProxy, uri: str) -> bytes:
    import boto3

    bucket, _, key = uri.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=proxy.upstream, region_name="us-east-1")
    return bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


@pytest.fixture
def s3_artifact(tmp_path: Path, faulty_proxy: FaultyProxy, bucket: str) -> tuple[str, str, dict]:  # type: ignore[type-arg]
    path = tmp_path / "m.safetensors"
    sd = write_artifact(path, scale=5)  # ~8 MB: two 5 MiB parts
    uri = upload(faulty_proxy.upstream, bucket, "models/m.safetensors", path)
    return uri, hashlib.sha256(path.read_bytes()).hexdigest(), sd


def test_s3_miss_streams_to_cache_and_device_then_hits(
    data_dir: Path,
    faulty_proxy: FaultyProxy,
    s3_artifact: tuple[str, str, dict],  # type: ignore[type-arg]
) -> None:
    uri, sha, sd = s3_artifact
    loader = WeightLoader(s3_settings(data_dir, faulty_proxy.url))
    faulty_proxy.faults = ["503", "cut"]
    miss = loader.load("m", "1", uri, sha)
    assert miss.report.cache == "miss"
    assert_same(miss.tensors, sd)
    stages = {s.name for s in miss.report.stages}
    assert {"fetch", "total"} <= stages
    gets = faulty_proxy.gets
    hit = loader.load("m", "1", uri, sha)
    assert hit.report.cache == "hit" and faulty_proxy.gets == gets
    assert_same(hit.tensors, sd)


def test_threads_share_one_fill(
    data_dir: Path,
    faulty_proxy: FaultyProxy,
    s3_artifact: tuple[str, str, dict],  # type: ignore[type-arg]
) -> None:
    uri, sha, sd = s3_artifact
    faulty_proxy.delay_s = 0.2
    loader = WeightLoader(s3_settings(data_dir, faulty_proxy.url))
    with ThreadPoolExecutor(3) as ex:
        results = list(ex.map(lambda _: loader.load("m", "1", uri, sha), range(3)))
    assert sorted(r.report.cache for r in results) == ["hit", "hit", "miss"]
    assert faulty_proxy.gets == 2
    for r in results:
        assert_same(r.tensors, sd)


def test_two_processes_one_download_identical_tensors(
    data_dir: Path,
    faulty_proxy: FaultyProxy,
    s3_artifact: tuple[str, str, dict],  # type: ignore[type-arg]
) -> None:
    uri, sha, sd = s3_artifact
    faulty_proxy.delay_s = 0.3  # both processes are inside load() while the fill runs
    settings = {
        "data_dir": str(data_dir), "s3_endpoint_url": faulty_proxy.url,
        "s3_allowed_buckets": "*", "s3_part_size_bytes": 5 * 1024 * 1024,
    }  # fmt: skip
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(settings, uri, sha, start, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(r[0] for r in results) == ["hit", "miss"]
    size = sum(r[1] for r in results)  # bytes fetched by both, together
    assert size == len(_object_bytes(faulty_proxy, uri))
    assert faulty_proxy.gets == 2  # one download: two 5 MiB parts, fetched once
    assert results[0][2] == results[1][2] == _digest_tensors(sd)
