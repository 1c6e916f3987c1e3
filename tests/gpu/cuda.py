"""What the CUDA tests share: the device they run on, the skip without one, and the
checks every one of them makes.

The tests in ``tests/gpu`` run on ``TEST_DEVICE`` (default ``cuda``). Without CUDA they
skip with a reason, so ``make test`` stays green on a machine without a GPU; ``make
gpu-check`` runs them on the GPU, and ``make gpu-check GPU_CHECK_DEVICE=cpu`` runs the very
same tests on the CPU (what is CUDA-only skips there) to prove they are not broken. Not
``EMBER_TEST_DEVICE``: every ``EMBER_*`` variable is a setting, and ``ember`` refuses
unknown ones.

Figures (tier timings, load rates) are attached to the test with pytest's
``record_property``: they land in the JUnit XML that ``scripts/gpu_check.py`` reads into
its JSON line, and are printed.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

DEVICE = torch.device(os.environ.get("TEST_DEVICE") or "cuda")
ON_CUDA = DEVICE.type == "cuda"
MIB = 1024 * 1024

needs_device = pytest.mark.skipif(
    ON_CUDA and not torch.cuda.is_available(), reason="needs an NVIDIA GPU (make gpu-check)"
)
"""Every test of tests/gpu: skipped without the device it runs on."""
cuda_only = pytest.mark.skipif(
    not ON_CUDA, reason=f"CUDA-only behaviour (TEST_DEVICE={DEVICE}: nothing to check)"
)


def on_device(t: torch.Tensor) -> bool:
    """``t`` is on the test device (``cuda`` means the current CUDA device)."""
    if t.device.type != DEVICE.type:
        return False
    return DEVICE.index is None or t.device.index == DEVICE.index


def assert_same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor on the test device, with exactly the reference's dtype, shape, bytes."""
    assert set(got) == set(want)
    for name, ref in want.items():
        t = got[name]
        assert on_device(t), f"{name} is on {t.device}, not {DEVICE}"
        assert (t.dtype, tuple(t.shape)) == (ref.dtype, tuple(ref.shape)), name
        left = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(left, ref.contiguous().reshape(-1).view(torch.uint8)), name


def synchronize() -> None:
    if ON_CUDA:
        torch.cuda.synchronize(DEVICE)


@contextmanager
def timed(record: Callable[[str, object], None], name: str) -> Iterator[None]:
    """Time the block (device work included) as figure ``name`` (seconds)."""
    synchronize()
    t0 = time.perf_counter()
    yield
    synchronize()
    seconds = round(time.perf_counter() - t0, 4)
    record(name, seconds)
    print(f"{name}: {seconds} s")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * MIB):
            h.update(chunk)
    return h.hexdigest()


def drop_pages(path: Path) -> None:
    """The file's pages out of the page cache, so the next read comes from the disk
    (through the loader's O_DIRECT path where the filesystem has one)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def device_bytes() -> int:
    """Bytes torch holds on the test device (0 off CUDA)."""
    return int(torch.cuda.memory_allocated(DEVICE)) if ON_CUDA else 0


def module_bytes(module: Any) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())
