"""NVMe cache: atomic verified fills, resume, corruption, LRU under a budget, pins, CLI."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ember.cli.cache import make_cache_app
from ember.config import Settings
from ember.errors import ArtifactError
from ember.loader.cache import PART, CacheFull, CacheKey, EntryPinned, WeightCache
from ember.loader.load import WeightLoader
from ember.loader.stores import open_store
from tests.loader.conftest import assert_same, write_artifact


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def artifact(settings: Settings) -> tuple[str, str, dict]:  # type: ignore[type-arg]
    objects = settings.data_dir / "objects"
    objects.mkdir()
    path = objects / "m.safetensors"
    sd = write_artifact(path)
    return path.as_uri(), sha(path), sd


def test_miss_then_hit(settings: Settings, artifact: tuple[str, str, dict]) -> None:  # type: ignore[type-arg]
    uri, digest, sd = artifact
    loader = WeightLoader(settings)
    first = loader.load("m", "1", uri, digest)
    assert first.report.cache == "miss" and first.report.bytes_fetched > 0
    assert_same(first.tensors, sd)
    second = loader.load("m", "1", uri, digest)
    assert second.report.cache == "hit" and second.report.bytes_fetched == 0
    assert_same(second.tensors, sd)
    entry = loader.cache.entry_dir(CacheKey("m", "1", digest))
    assert sorted(p.name for p in entry.iterdir() if not p.name.endswith(".lock")) == [
        "meta.json", "weights.safetensors",
    ]  # fmt: skip
    first.pin and first.pin.release()
    second.pin and second.pin.release()


def test_streamed_tensors_arrive_before_the_load_ends(
    settings: Settings,
    artifact: tuple[str, str, dict],  # type: ignore[type-arg]
) -> None:
    uri, digest, sd = artifact
    stream = WeightLoader(settings).stream("m", "1", uri, digest)
    names = [name for name, _ in stream]
    assert sorted(names) == sorted(sd) and stream.report is not None


def test_interrupted_fill_resumes_and_never_looks_complete(
    settings: Settings,
    artifact: tuple[str, str, dict],  # type: ignore[type-arg]
) -> None:
    uri, digest, sd = artifact
    cache = WeightCache.from_settings(settings)
    key = CacheKey("m", "1", digest)
    store = open_store(uri, settings)
    info = store.stat(uri)
    seen = 0

    def crash(offset: int, chunk: memoryview) -> None:
        nonlocal seen
        seen += len(chunk)
        if seen > 1024 * 1024:
            raise KeyboardInterrupt  # the process dies mid-fill

    small = settings.model_copy(update={"s3_part_size_bytes": 5 * 1024 * 1024})
    store.default_part_bytes = 256 * 1024
    with pytest.raises(KeyboardInterrupt), cache.fill_lock(key):
        cache.fill(key, store, info, sink=crash)
    assert (cache.entry_dir(key) / PART).exists()
    assert cache.lookup(key) is None and cache.checked(key) is None
    with cache.fill_lock(key):
        result = cache.fill(key, store, info)
    assert 0 < result.bytes_resumed < info.size
    assert result.bytes_resumed + result.bytes_fetched == info.size
    assert sha(result.path) == digest
    loaded = WeightLoader(small, cache).load("m", "1", uri, digest)
    assert loaded.report.cache == "hit"
    assert_same(loaded.tensors, sd)


def test_partial_of_a_changed_object_is_restarted(
    settings: Settings,
    artifact: tuple[str, str, dict],  # type: ignore[type-arg]
) -> None:
    uri, digest, _ = artifact
    cache = WeightCache.from_settings(settings)
    key = CacheKey("m", "1", digest)
    entry = cache.entry_dir(key)
    entry.mkdir(parents=True)
    (entry / PART).write_bytes(b"\xff" * 4096)  # left by a fill of another object
    (entry / "part.json").write_text('{"etag": "old", "size": 1, "uri": "x"}')
    store = open_store(uri, settings)
    with cache.fill_lock(key):
        result = cache.fill(key, store, store.stat(uri))
    assert result.bytes_resumed == 0 and sha(result.path) == digest


def test_bit_flip_in_cache_is_discarded_and_refetched(
    data_dir: Path,
    artifact: tuple[str, str, dict],  # type: ignore[type-arg]
) -> None:
    uri, digest, sd = artifact
    settings = Settings(data_dir=data_dir, cache_verify_after_s=0)
    loader = WeightLoader(settings)
    loader.load("m", "1", uri, digest).pin.release()  # type: ignore[union-attr]
    path = loader.cache.weights_path(CacheKey("m", "1", digest))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    path.write_bytes(raw)
    again = loader.load("m", "1", uri, digest)
    assert again.report.cache == "refetched"
    assert_same(again.tensors, sd)
    assert sha(path) == digest


def test_bad_source_is_a_clear_error_and_leaves_nothing(
    settings: Settings,
    artifact: tuple[str, str, dict],  # type: ignore[type-arg]
) -> None:
    uri, _, _ = artifact
    wrong = "0" * 64
    loader = WeightLoader(settings)
    with pytest.raises(ArtifactError, match="is not the registered one"):
        loader.load("m", "1", uri, wrong)
    entry = loader.cache.entry_dir(CacheKey("m", "1", wrong))
    assert not (entry / "weights.safetensors").exists() and not (entry / PART).exists()


def _fill(cache: WeightCache, settings: Settings, name: str, seed: int) -> CacheKey:
    path = settings.data_dir / "objects" / f"{name}.safetensors"
    path.parent.mkdir(exist_ok=True)
    write_artifact(path, seed=seed)
    key = CacheKey(name, "1", sha(path))
    store = open_store(path.as_uri(), settings)
    with cache.fill_lock(key):
        cache.fill(key, store, store.stat(path.as_uri()))
    return key


def test_lru_eviction_under_budget_skips_pinned(settings: Settings) -> None:
    cache = WeightCache(settings.weight_cache_dir, max_bytes=10**9)
    a = _fill(cache, settings, "a", 1)
    cache.max_bytes = int(2.5 * cache.weights_path(a).stat().st_size)  # room for two
    b = _fill(cache, settings, "b", 2)
    os.utime(cache.weights_path(a), (1, 1))  # a is the least recently used ...
    os.utime(cache.weights_path(b), (2, 2))
    with cache.pin(a):  # ... but a live replica uses it
        c = _fill(cache, settings, "c", 3)
        assert cache.lookup(a) and cache.lookup(c) and not cache.lookup(b)
        with cache.pin(c), pytest.raises(CacheFull):
            _fill(cache, settings, "d", 4)
        with pytest.raises(EntryPinned):
            cache.evict("a", "1")
    assert cache.evict("a", "1") == [a]
    assert {e.key for e in cache.ls()} == {c}


def test_cli_ls_warm_evict(
    settings: Settings,
    artifact: tuple[str, str, dict],
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[type-arg]
) -> None:
    uri, digest, _ = artifact
    monkeypatch.setenv("EMBER_DATA_DIR", str(settings.data_dir))
    app = make_cache_app(lambda s, model, version: (uri, digest, None))
    runner = CliRunner()
    warm = runner.invoke(app, ["warm", "m:1"])
    assert warm.exit_code == 0, warm.output
    assert "cached" in warm.output
    assert "already cached" in runner.invoke(app, ["warm", "m:1"]).output
    listing = runner.invoke(app, ["ls"])
    assert "m:1" in listing.output and digest[:12] in listing.output and "ready" in listing.output
    assert "evicted 1 entry" in runner.invoke(app, ["evict", "m:1"]).output
    assert "0 entries" in runner.invoke(app, ["ls"]).output
    bare = runner.invoke(make_cache_app(), ["warm", "m:1"])
    assert bare.exit_code == 1 and "--uri" in bare.output


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files away needs root")
def test_what_root_makes_in_a_tenants_cache_stays_the_tenants(tmp_path: Path) -> None:
    """The API (root) pinning an entry in a tenant's directory (its replicas' uid's) makes
    the entry's directories and lock files that uid's, so its replicas can still fill and
    evict there; a lock file that is a link is refused, never followed."""
    root = tmp_path / "cache"
    tenant = root / "t2"
    tenant.mkdir(parents=True)
    os.chown(tenant, 61002, 61002)
    cache = WeightCache(root, 10**9, lock_timeout_s=1)
    key = CacheKey("m", "1", "a" * 64, tenant=2)
    cache.pin(key).release()
    entry = cache.entry_dir(key)
    made = [p for p in (entry, entry / "pin.lock", *entry.parents) if p.is_relative_to(tenant)]
    assert {p.stat().st_uid for p in made} == {61002}, made
    target = tmp_path / "not-a-lock"
    other = CacheKey("m", "2", "b" * 64, tenant=2)
    cache.entry_dir(other).mkdir(parents=True)
    (cache.entry_dir(other) / "pin.lock").symlink_to(target)
    with pytest.raises(OSError):
        cache.pin(other)
    assert not target.exists()
