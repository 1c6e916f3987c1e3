"""The shared warm tier: cache entries held resident (mlocked) within a budget, pinned
against the cache's LRU, released when no longer wanted."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from ember.config import Settings
from ember.loader import pagecache
from ember.loader.cache import CacheKey, EntryPinned
from ember.loader.load import WeightLoader
from ember.loader.warmset import WarmSet
from tests.loader.conftest import write_artifact


def _entry(settings: Settings, loader: WeightLoader, name: str, seed: int) -> CacheKey:
    path = settings.data_dir / "objects" / f"{name}.safetensors"
    path.parent.mkdir(exist_ok=True)
    write_artifact(path, seed=seed)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    loader.warm(name, "1", path.as_uri(), sha)
    return CacheKey(name, "1", sha)


@pytest.fixture
def loader(settings: Settings) -> WeightLoader:
    return WeightLoader(settings)


def test_a_pinned_file_stays_in_the_page_cache_until_closed(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    path.write_bytes(b"\x01" * (3 * 1024 * 1024 + 123))
    pagecache.drop(path)
    assert pagecache.resident_fraction(path) < 1.0
    with pagecache.PinnedFile(path) as pinned:
        assert pinned.locked, pinned.lock_error  # the suite runs as root (CAP_IPC_LOCK)
        assert pagecache.resident_fraction(path) == 1.0
        pagecache.drop(path)  # a reclaim asking for the pages gets none of them
        assert pagecache.resident_fraction(path) == 1.0
        assert pinned.refresh() == 0
    pagecache.drop(path)
    assert pagecache.resident_fraction(path) < 1.0


def test_an_unlocked_pinned_file_is_read_in(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    path.write_bytes(b"\x02" * (1024 * 1024))
    pagecache.drop(path)
    with pagecache.PinnedFile(path, lock=False) as pinned:
        assert not pinned.locked
        assert pagecache.resident_fraction(path) == 1.0
        assert pinned.refresh() == 0
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pagecache.PinnedFile(empty) as nothing:  # nothing to map: nothing to hold
        assert nothing.size == 0 and not nothing.locked


def test_the_warm_set_holds_the_most_wanted_within_its_budget(
    settings: Settings, loader: WeightLoader
) -> None:
    a = _entry(settings, loader, "a", 1)
    b = _entry(settings, loader, "b", 2)
    c = _entry(settings, loader, "c", 3)
    cache = loader.cache
    size = cache.weights_path(a).stat().st_size
    for key in (a, b, c):
        pagecache.drop(cache.weights_path(key))
    warm = WarmSet(cache, max_bytes=int(2.5 * size))  # room for two
    try:
        assert warm.sync([b, a, c]) == [b, a]
        assert warm.bytes_held == 2 * size
        for key, resident in ((a, True), (b, True), (c, False)):
            pagecache.drop(cache.weights_path(key))
            fraction = pagecache.resident_fraction(cache.weights_path(key))
            assert (fraction == 1.0) is resident, key
        with pytest.raises(EntryPinned):  # the cache's LRU cannot take a held entry
            cache.evict("a", "1")
        # demand moved: c in, b out (a stays without being read again)
        since = warm.held[a].since
        assert warm.sync([c, a]) == [c, a]
        assert warm.held[a].since == since
        assert cache.evict("b", "1") == [b]
        assert {i["model"] for i in warm.info()} == {"a", "c"}
        # a version the cache does not have is skipped, not an error
        missing = CacheKey("ghost", "1", "0" * 64)
        assert warm.sync([missing, a]) == [a]
    finally:
        warm.close()
    assert warm.held == {}
    assert cache.evict("a", "1") == [a]  # pins released


def test_a_load_of_a_held_version_reads_nothing_from_the_disk(
    settings: Settings, loader: WeightLoader
) -> None:
    import torch

    from ember.loader import device
    from ember.loader.load import read_header

    key = _entry(settings, loader, "m", 7)
    path = loader.cache.weights_path(key)
    pagecache.drop(path)
    warm = WarmSet(loader.cache, max_bytes=1 << 30)
    try:
        warm.sync([key])
        pagecache.drop(path)
        header = read_header(path, settings.artifact_max_header_bytes)

        dest = device.allocate(header, torch.device("cpu"), whole_file=True)
        placement = device.FilePlacement(
            path, dest, threads=2, chunk_bytes=1 << 20, staging_bytes=8 << 20, direct_io=True
        )
        placement.run(lambda names: None)
        assert placement.bytes_direct == 0  # every chunk came from host RAM
        assert placement.bytes_buffered >= header.data_len
    finally:
        warm.close()
