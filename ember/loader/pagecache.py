"""Page-cache helpers (Linux): which pages of a file are resident, drop them, O_DIRECT.

Torch-free. The device placement reads resident ranges through the page cache (a copy
at memory speed) and the rest with O_DIRECT (no copy into the page cache, several reads
in flight), so it asks ``resident_pages`` first. The bench uses ``drop`` to start cold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

PAGE = mmap.PAGESIZE
#: O_DIRECT needs offsets, lengths and buffer addresses aligned to the logical block size;
#: 4 KiB covers every device we run on (512-byte and 4K-native).
DIRECT_ALIGN = 4096

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path: Path | str) -> bytearray:
    """One byte per page of the file, bit 0 set when the page is in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        vec = bytearray((size + PAGE - 1) // PAGE)
        if size == 0:
            return vec
        # Map without touching: mincore reports the page cache, it faults nothing in.
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            out = (ctypes.c_ubyte * len(vec)).from_buffer(vec)
            if _libc.mincore(addr, size, out) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore of {path} failed: {os.strerror(err)}")
            del out
        finally:
            _libc.munmap(addr, size)
        return vec
    finally:
        os.close(fd)


def resident_fraction(path: Path | str) -> float:
    vec = resident_pages(path)
    return sum(b & 1 for b in vec) / len(vec) if vec else 1.0


def drop(path: Path | str) -> None:
    """Ask the kernel to drop the file's clean pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def open_direct(path: Path | str) -> int | None:
    """An O_DIRECT read descriptor, or ``None`` where the filesystem refuses it (tmpfs)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
