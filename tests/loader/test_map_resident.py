"""A cache entry the page cache holds whole is mapped, not copied: copy-on-write views of
the page cache, every page mapped before the load returns."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from ember.config import Settings
from ember.loader import pagecache
from ember.loader.load import WeightLoader, load_file
from tests.loader.conftest import assert_same, write_artifact

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402


def aligned_artifact(path: Path) -> dict[str, torch.Tensor]:
    """fp32, bf16 and int64 tensors, every one at an offset aligned for its dtype."""
    gen = torch.Generator().manual_seed(3)
    sd = {
        "a.weight": torch.randn(300, 64, generator=gen),
        "b.weight": torch.randn(64, 64, generator=gen).to(torch.bfloat16),
        "c.index": torch.arange(10, dtype=torch.int64),
        "d.bias": torch.randn(64, generator=gen),
    }
    save_file(sd, str(path))
    return sd


def stages(loaded: object) -> list[str]:
    return [s.name for s in loaded.report.stages]  # type: ignore[attr-defined]


def test_a_resident_file_is_mapped_copy_on_write(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    want = aligned_artifact(path)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    assert pagecache.fully_resident(path)  # just read back whole
    first = load_file(path)
    assert "map" in stages(first) and "place" not in stages(first)
    assert_same(first.tensors, want)
    # A tensor written in place gets its own pages: not the file's, not another load's.
    first.tensors["a.weight"][0, 0] = 1e6
    second = load_file(path)
    assert_same(second.tensors, want)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert float(first.tensors["a.weight"][0, 0]) == 1e6


def test_what_cannot_be_mapped_is_read(tmp_path: Path) -> None:
    # A writer that does not sort by alignment (safetensors' own does): an F32 tensor
    # after 3 bytes of U8 is misaligned for its dtype, so the file is read instead.
    odd = tmp_path / "odd.safetensors"
    header = json.dumps(
        {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
         "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}
    ).encode()  # fmt: skip
    header += b" " * (-len(header) % 8)
    values = torch.tensor([1.5, -2.0])
    data = bytes([1, 2, 3]) + values.numpy().tobytes()
    odd.write_bytes(struct.pack("<Q", len(header)) + header + data)
    assert pagecache.fully_resident(odd)
    got = load_file(odd)
    assert "place" in stages(got) and "map" not in stages(got)
    assert_same(got.tensors, {"a": torch.tensor([1, 2, 3], dtype=torch.uint8), "b": values})
    # The artifacts safetensors writes (odd sizes, mixed dtypes) are all mapped.
    mixed = tmp_path / "mixed.safetensors"
    want = write_artifact(mixed)
    got = load_file(mixed)
    assert "map" in stages(got)
    assert_same(got.tensors, want)
    # Not held whole by the page cache: read (O_DIRECT where it can), never mapped lazily.
    path = tmp_path / "m.safetensors"
    want = aligned_artifact(path)
    pagecache.drop(path)
    if pagecache.fully_resident(path):
        pytest.skip("this filesystem keeps the pages")
    cold = load_file(path)
    assert "place" in stages(cold)
    assert_same(cold.tensors, want)
    # Switched off: always read.
    off = load_file(path, settings=Settings(loader_map_resident=False))
    assert "place" in stages(off)
    assert_same(off.tensors, want)


def test_a_cache_hit_held_in_ram_is_mapped(settings: Settings) -> None:
    source = settings.data_dir / "objects" / "m.safetensors"
    source.parent.mkdir(parents=True, exist_ok=True)
    want = aligned_artifact(source)
    sha = hashlib.sha256(source.read_bytes()).hexdigest()
    loader = WeightLoader(settings)
    miss = loader.load("m", "1", source.as_uri(), sha)  # filled: the file is resident now
    assert miss.report.cache == "miss"
    assert_same(miss.tensors, want)
    hit = loader.load("m", "1", source.as_uri(), sha)
    assert hit.report.cache == "hit" and "map" in stages(hit)
    assert_same(hit.tensors, want)


def locked_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1])
    return 0


def test_mapped_weights_stay_locked_in_ram_while_they_live(tmp_path: Path) -> None:
    import gc
    import time

    path = tmp_path / "m.safetensors"
    want = aligned_artifact(path)
    probe = pagecache.PinnedFile(path)
    can_lock = probe.locked
    probe.close()
    if not can_lock:
        pytest.skip("this process may not lock memory")
    before = locked_kib()
    size_kib = path.stat().st_size // 1024
    got = load_file(path)
    assert "map" in stages(got)
    # pinned just after the load (in a thread): a reclaim daemon cannot take the pages
    deadline = time.monotonic() + 10
    while locked_kib() < before + size_kib and time.monotonic() < deadline:
        time.sleep(0.01)
    assert locked_kib() >= before + size_kib
    tensors = got.tensors
    del got
    gc.collect()
    assert locked_kib() >= before + size_kib  # the tensors still live: still held
    assert_same(tensors, want)
    del tensors
    gc.collect()
    assert locked_kib() == before  # the mapping is gone: so is the lock
