"""A standby process's host reserve: memory faulted in ahead, taken by the one load that
fits in it (its tail given back), dropped by anything else."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ember.config import Settings
from ember.loader import pagecache
from ember.loader.load import load_file
from ember.loader.pagecache import HUGE_PAGE, RESERVE, HostReserve
from tests.loader.conftest import assert_same

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

MIB = 1024 * 1024


def filled(reserve: HostReserve, nbytes: int) -> HostReserve:
    reserve.fill(nbytes)
    deadline = time.monotonic() + 30
    while not reserve.ready:
        assert time.monotonic() < deadline, "the reserve never filled"
        time.sleep(0.01)
    return reserve


def resident_kib(start: int, length: int) -> int:
    """Rss of this process's mapping that contains ``start`` (from /proc/self/smaps)."""
    rss, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= start < hi and start + length <= hi
        elif inside and head == "Rss:":
            rss = int(line.split()[1])
    assert rss is not None
    return rss


def test_a_load_takes_the_reserve_and_gives_back_its_tail() -> None:
    reserve = filled(HostReserve(), 64 * MIB)
    assert reserve.nbytes == 64 * MIB
    view = reserve.take(5 * MIB + 1)
    assert view is not None and len(view) == 5 * MIB + 1
    assert reserve.nbytes == 0 and not reserve.ready and reserve.take(1) is None  # one load
    addr = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    # The first 6 MiB (whole huge pages) stay faulted in; the other 58 MiB are given back.
    assert 6 * 1024 <= resident_kib(addr, len(view)) < 16 * 1024


def test_a_load_larger_than_the_reserve_drops_it() -> None:
    reserve = filled(HostReserve(), 4 * MIB)
    assert reserve.take(4 * MIB + 1) is None
    assert reserve.nbytes == 0 and not reserve.ready


def test_a_reserve_beyond_half_the_available_memory_is_not_taken() -> None:
    available = pagecache.available_bytes()
    assert available is not None and available > 0
    reserve = HostReserve()
    reserve.fill(available)  # would leave the host too little: no reserve at all
    assert reserve.nbytes == 0 and not reserve.ready and reserve.take(MIB) is None


def test_release_drops_a_fill_still_running() -> None:
    reserve = HostReserve()
    reserve.fill(256 * MIB)
    reserve.release()
    time.sleep(0.5)
    assert reserve.nbytes == 0 and not reserve.ready and reserve.take(MIB) is None


def test_a_cpu_load_lands_in_the_process_reserve(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    want = {
        "w": torch.randn(512, 512, generator=gen),
        "b": torch.randn(512, generator=gen).to(torch.bfloat16),
    }
    path = tmp_path / "m.safetensors"
    save_file(want, str(path))
    try:
        filled(RESERVE, 4 * HUGE_PAGE)
        anchor = RESERVE._buf
        assert anchor is not None
        lo = torch.frombuffer(anchor, dtype=torch.uint8).data_ptr()
        # map_resident off: the file was just written, so the page cache holds it whole.
        loaded = load_file(path, settings=Settings(loader_map_resident=False))
        assert_same(loaded.tensors, want)
        ptr = loaded.tensors["w"].data_ptr()
        assert lo <= ptr < lo + 4 * HUGE_PAGE  # the weights are in the memory faulted ahead
        assert RESERVE.nbytes == 0
        second = load_file(path, settings=Settings(loader_map_resident=False))
        assert_same(second.tensors, want)  # the next load allocates as before
    finally:
        RESERVE.release()
