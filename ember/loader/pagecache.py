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
import threading
from pathlib import Path

PAGE = mmap.PAGESIZE
#: O_DIRECT needs offsets, lengths and buffer addresses aligned to the logical block size;
#: 4 KiB covers every device we run on (512-byte and 4K-native).
DIRECT_ALIGN = 4096
#: Transparent huge page size (x86-64 and most arm64 kernels).
HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14
_MADV_POPULATE_READ = 22  # Linux 5.14+: reads a file range in and maps it, one call
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; faults a range in far faster than touching it
_MADV_WILLNEED = 3
_MADV_DONTNEED = 4

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
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def whole_huge_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole 2 MiB pages."""
    return -(-nbytes // HUGE_PAGE) * HUGE_PAGE


def _address(buf: mmap.mmap | memoryview) -> int:
    """The address of a writable buffer's first byte."""
    anchor = ctypes.c_char.from_buffer(buf)
    addr = ctypes.addressof(anchor)
    del anchor  # the export must not outlive this call (the caller's object keeps the memory)
    return addr


def host_buffer(nbytes: int, *, populate: bool = False) -> memoryview:
    """``nbytes`` of private anonymous memory, 2 MiB aligned, transparent huge pages asked
    for (``MADV_HUGEPAGE``). The view keeps the mapping alive.

    Why it matters: an ``O_DIRECT`` read is built from the buffer's physical segments, and
    a block device takes a bounded number of segments per request (virtio: ~254). On 4 KiB
    pages that caps a request near 1 MiB — measured here, 0.5-0.9 GB/s from a disk that
    gives 2.6-2.9 GB/s to the same reads into huge pages (4 MiB requests). Copies out of
    huge pages also miss the TLB far less. Where the kernel has no huge page to give, the
    memory is ordinary pages and everything still works, only slower.
    (``mmap.mmap(-1, n)`` is a *shared* mapping — shmem — which gets no huge pages.)
    """
    size = max(nbytes, 1)
    mm = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = _address(mm)
    skip = (-addr) % HUGE_PAGE
    _libc.madvise(addr + skip, size, _MADV_HUGEPAGE)  # advisory: a refusal is harmless
    if populate:
        populate_range(addr + skip, size)
    return memoryview(mm)[skip : skip + nbytes]


def populate_range(addr: int, nbytes: int) -> None:
    """Fault ``[addr, addr + nbytes)`` in for writing with one call (huge pages where the
    range allows). ctypes releases the GIL, so threads populate in parallel. Kernels
    before 5.14 refuse it: the pages then fault in on first write instead."""
    _libc.madvise(addr, nbytes, _MADV_POPULATE_WRITE)


class HostReserve:
    """Host memory faulted in ahead of a weight load: what a standby process holds for the
    version it may be given, so that its load only reads.

    Why: a load's destination is fresh memory, and fresh memory costs its first touch. On
    a virtual machine whose guest hands freed memory back to the host (free page
    reporting, as on the machines this runs on), that touch is a host fault: measured here
    0.6-2.3 GB/s for memory idle a second or more, against ~7 GB/s for memory freed just
    before. A 1 GiB load from a 3.6 GB/s disk then ran at 1.4 GB/s. Memory this process
    keeps touched is not handed back.

    ``fill`` faults the memory in on a thread (the process answers meanwhile). One load
    ``take``s it: its first bytes, the rest given back to the system; a later load, or a
    load larger than the reserve, allocates as before. ``release`` gives it all back (a
    load that needed none, e.g. of weights the page cache holds and the loader maps)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf: memoryview | None = None
        self._want = 0
        self._filling: threading.Thread | None = None

    @property
    def nbytes(self) -> int:
        """Bytes reserved or being faulted in (0 once taken or released)."""
        with self._lock:
            return self._want

    @property
    def ready(self) -> bool:
        """Whether the reserve is faulted in (False while its fill runs, or with none)."""
        with self._lock:
            return self._buf is not None

    def fill(self, nbytes: int) -> None:
        """Fault ``nbytes`` of huge-page-backed memory in, on a thread; nothing when that
        is more than half of the memory the system has available (a reserve must never
        be what gets a host's processes OOM-killed)."""
        self.release()
        available = available_bytes()
        if nbytes <= 0 or (available is not None and nbytes > available // 2):
            return

        def run() -> None:
            try:
                buf = host_buffer(nbytes, populate=True)
            except (OSError, ValueError):  # no memory to map: loads allocate as before
                buf = None
            with self._lock:
                if self._want == nbytes and self._filling is threading.current_thread():
                    self._buf = buf

        thread = threading.Thread(target=run, name="ember-reserve", daemon=True)
        with self._lock:
            self._want, self._filling = nbytes, thread
        thread.start()

    def take(self, nbytes: int) -> memoryview | None:
        """The first ``nbytes`` of the reserve (waiting for its fill), the tail given back;
        None, and the reserve dropped, when it is smaller or there is none."""
        with self._lock:
            want, filling = self._want, self._filling
        if want < nbytes:
            self.release()
            return None
        if filling is not None:
            filling.join()
        with self._lock:
            buf, self._buf, self._want, self._filling = self._buf, None, 0, None
        if buf is None:
            return None
        keep = whole_huge_pages(nbytes)
        if keep < len(buf):
            _libc.madvise(_address(buf) + keep, len(buf) - keep, _MADV_DONTNEED)
        return buf[:nbytes]

    def release(self) -> None:
        """Give the reserve back (a fill still running finishes and is dropped)."""
        with self._lock:
            self._buf, self._want, self._filling = None, 0, None


def available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (None where there is no such file)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


RESERVE = HostReserve()
"""This process's reserve (``ember engine --standby --reserve-bytes``)."""


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


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_uint64)
        for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


_SYS_CACHESTAT = 451  # the same number on x86-64 and arm64 (Linux 6.5+)
_libc.syscall.restype = ctypes.c_long
_cachestat_works = True


def cached_pages(fd: int, offset: int, length: int) -> int | None:
    """How many pages of ``[offset, offset + length)`` are in the page cache (``cachestat``:
    a walk of the cache itself, several times cheaper than mapping the file for
    ``mincore``), or ``None`` where the kernel lacks it (before 6.5)."""
    global _cachestat_works
    if not _cachestat_works:
        return None
    rng, out = _CachestatRange(offset, length), _Cachestat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
        _cachestat_works = False  # ENOSYS (old kernel) or a seccomp refusal: use mincore
        return None
    return int(out.nr_cache)


MINCORE_BIT0 = bytes(b & 1 for b in range(256))  # mincore: only bit 0 of each byte is defined


def fully_resident(path: Path | str) -> bool:
    """Whether the page cache holds every page of the file (one ``cachestat`` call where
    the kernel has it, else ``mincore``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pages = -(-size // PAGE)
        cached = cached_pages(fd, 0, pages * PAGE) if size else 0
    finally:
        os.close(fd)
    if cached is not None:
        return cached >= pages
    return 0 not in resident_pages(path).translate(MINCORE_BIT0)


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


def read_direct(path: Path | str, threads: int = 4, chunk: int = 16 * 1024 * 1024) -> int:
    """Read the whole file with ``O_DIRECT`` by ``threads`` threads, sequential ``chunk``
    reads into huge-page buffers; returns the bytes read. The benches time this as the
    disk's limit (the best the loader could do with no copy at all)."""
    import threading

    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [host_buffer(chunk, populate=True) for _ in range(threads)]
    offsets = iter(range(0, size, chunk))
    lock = threading.Lock()
    got = [0] * threads

    def work(i: int) -> None:
        while True:
            with lock:
                off = next(offsets, None)
            if off is None:
                return
            got[i] += os.preadv(fd, [bufs[i]], off)

    try:
        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        os.close(fd)
    return sum(got)


class PinnedFile:
    """A file's pages held in the page cache: mapped read-only and ``mlock``-ed, so that
    neither memory pressure nor a proactive reclaim daemon (DAMON, MGLRU aging) evicts
    them, and a later read of the file is a copy at memory speed.

    Where the process may not lock that much memory (no ``CAP_IPC_LOCK`` and a small
    ``RLIMIT_MEMLOCK``), the pages are read in and ``locked`` is False: they are then only
    as resident as the kernel leaves them, and ``refresh`` reads back what it evicted.
    Reading the file in takes as long as a buffered read of it: call this off the event
    loop.
    """

    def __init__(self, path: Path | str, *, lock: bool = True) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            self.addr: int | None = None
            self.locked = False
            self.lock_error: str | None = None
            if self.size == 0:
                return
            addr = _libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == _MAP_FAILED:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap of {self.path} failed: {os.strerror(err)}")
            self.addr = int(addr)
        finally:
            os.close(fd)  # the mapping keeps the file (and its pages) referenced
        if lock:
            if _libc.mlock(self.addr, self.size) == 0:  # faults every page in, then pins
                self.locked = True
            else:
                self.lock_error = os.strerror(ctypes.get_errno())
        if not self.locked:
            self.refresh()

    def refresh(self) -> int:
        """Read back the pages the kernel evicted (none when locked); returns how many
        were missing."""
        if self.addr is None or self.locked:
            return 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            cached = cached_pages(fd, 0, self.size)
        finally:
            os.close(fd)
        pages = -(-self.size // PAGE)
        missing = pages - cached if cached is not None else pages
        if missing:
            _libc.madvise(self.addr, self.size, _MADV_WILLNEED)
            _libc.madvise(self.addr, self.size, _MADV_POPULATE_READ)
        return missing

    def close(self) -> None:
        if self.addr is None:
            return
        if self.locked:
            _libc.munlock(self.addr, self.size)
        _libc.munmap(self.addr, self.size)
        self.addr, self.locked = None, False

    def __enter__(self) -> PinnedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
