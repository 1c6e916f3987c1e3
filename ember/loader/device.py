"""Device placement: safetensors bytes -> tensors on the device, one pass, no lazy pages.

The only loader module that imports torch (do not import it from the control plane).

Two sources feed it:

* a **local file** (cache hit, or a file given directly): ``FilePlacement`` plans the
  data section in aligned chunks and lets ``loader_threads`` workers each read a chunk
  and put it in place. Chunks the page cache holds (``cachestat``, else ``mincore``)
  are read through it; the others with ``O_DIRECT`` into huge-page memory (no
  page-cache copy, 4 MiB requests, several in flight).
* a **stream of chunks** from the object store during a cache fill: ``StreamPlacement``
  copies each chunk into place as it arrives.

Destinations:

* CPU, no ``into``: one 4 KiB-aligned buffer for the whole data section, read straight
  into (``O_DIRECT`` where possible); every tensor is a view of it — no second copy.
* CPU ``into`` (preallocated tensors, e.g. a module's parameters): resident chunks are
  ``preadv``'d straight into the destinations, the rest go through a staging slot.
* CUDA: every chunk goes through a pinned staging slot and a ``non_blocking`` copy on the
  worker's side stream; a slot is reused only after its copy's event has completed.

Staging slots come from a per-device pool that is allocated and touched once per process
and reused by every load (fresh memory faults in slowly; pinning is slower still).
A tensor is reported complete only when its bytes are really resident on the device.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.domain.safetensors import DTYPE_BITS, PREFIX_BYTES, Header, TensorSpec
from ember.errors import ArtifactError, LoaderError, ObjectChanged
from ember.loader.pagecache import (
    DIRECT_ALIGN,
    MINCORE_BIT0,
    PAGE,
    RESERVE,
    cached_pages,
    host_buffer,
    open_direct,
    populate_range,
    resident_pages,
)
from ember.logs import submit_in_context

if TYPE_CHECKING:
    import torch


def torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors dtype -> torch dtype, for every dtype this torch build has."""
    import torch

    names = {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
        "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64",
        "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
        "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "F8_E8M0": "float8_e8m0fnu",
    }  # fmt: skip
    return {k: getattr(torch, v) for k, v in names.items() if hasattr(torch, v)}


def _align_down(n: int) -> int:
    return n - n % DIRECT_ALIGN


def _align_up(n: int) -> int:
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


# --- staging -------------------------------------------------------------------------
class StagingPool:
    """Fixed slots of page-aligned host memory (pinned for CUDA), touched once, reused."""

    def __init__(self, device: torch.device, total_bytes: int, slot_bytes: int) -> None:
        import torch

        self.slot_bytes = slot_bytes
        count = max(2, total_bytes // slot_bytes)
        self.total_bytes = count * slot_bytes
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.slots: list[torch.Tensor] = []
        self._keep: list[Any] = []
        for i in range(count):
            if device.type == "cuda":
                raw = torch.empty(slot_bytes + PAGE, dtype=torch.uint8, pin_memory=True)
                start = (-raw.data_ptr()) % PAGE
                slot = raw[start : start + slot_bytes]
                self._keep.append(raw)
            else:  # huge pages: O_DIRECT reads into them go to the disk as 4 MiB requests
                slot = torch.frombuffer(host_buffer(slot_bytes, populate=True), dtype=torch.uint8)
            slot.fill_(0)  # fault every page in now, not during a load
            self.slots.append(slot)
            self._free.put(i)

    def acquire(self) -> int:
        return self._free.get()

    def release(self, index: int) -> None:
        self._free.put(index)


_pools: dict[tuple[str, int, int], StagingPool] = {}
_pools_lock = threading.Lock()


def staging_pool(device: torch.device, total_bytes: int, slot_bytes: int) -> StagingPool:
    """The process-wide pool for ``device`` (created on first use, then reused)."""
    key = (str(device), total_bytes, slot_bytes)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = StagingPool(device, total_bytes, slot_bytes)
        return pool


# --- destinations --------------------------------------------------------------------
@dataclass
class Destinations:
    """Where each tensor's bytes go: a uint8 alias of the destination tensor's memory."""

    header: Header
    device: torch.device
    tensors: dict[str, torch.Tensor]
    raw: dict[str, torch.Tensor]
    """name -> 1-D uint8 tensor aliasing the destination's bytes."""
    whole: torch.Tensor | None = None
    """CPU only: one buffer holding file bytes ``[base, ...)``; tensors are views."""
    base: int = 0
    """File offset of ``whole[0]`` (4 KiB aligned)."""
    host: dict[str, memoryview] = field(default_factory=dict)
    """name -> writable memoryview of a CPU destination (for direct reads)."""
    mapping: Any = None
    """``map_resident``: the file's mapping (alive while any of the tensors is)."""
    apart: set[str] = field(default_factory=set)
    """With ``whole``: tensors misaligned there for their dtype, so in storage of their
    own; their bytes are copied out of ``whole`` as they arrive."""


def _byte_alias(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().reshape(-1).view(torch.uint8)


def _dtypes_of(header: Header) -> dict[str, torch.dtype]:
    """``torch_dtypes()``, once every tensor's dtype is known to be among them."""
    dtypes = torch_dtypes()
    for spec in header.tensors:
        if spec.dtype not in dtypes:
            raise ArtifactError(f"tensor {spec.name!r}: dtype {spec.dtype} has no torch dtype")
    return dtypes


def _aligned(spec: TensorSpec, file_offset: int) -> bool:
    """Whether a tensor at ``file_offset`` is aligned for its dtype (a view of it works)."""
    return file_offset % max(1, DTYPE_BITS[spec.dtype] // 8) == 0


def allocate(header: Header, device: torch.device, *, whole_file: bool) -> Destinations:
    """Fresh destinations. On CPU: one aligned buffer, tensors are views of it."""
    import torch

    dtypes = _dtypes_of(header)
    if device.type != "cpu":
        tensors = {
            s.name: torch.empty(s.shape, dtype=dtypes[s.dtype], device=device)
            for s in header.tensors
        }
        raw = {n: _byte_alias(t) for n, t in tensors.items()}
        return Destinations(header, device, tensors, raw)
    base = _align_down(header.data_offset) if whole_file else header.data_offset
    end = _align_up(header.file_size) if whole_file else header.file_size
    whole = _aligned_host_buffer(end - base)
    tensors, raw = {}, {}
    apart = set()
    for s in header.tensors:
        lo = header.data_offset + s.begin - base
        chunk = whole[lo : lo + s.nbytes]
        if not _aligned(s, lo):  # misaligned for its dtype (odd-sized neighbour): own storage
            t = torch.empty(s.shape, dtype=dtypes[s.dtype])
            raw[s.name] = _byte_alias(t)
            apart.add(s.name)
        else:
            t = chunk.view(dtypes[s.dtype]).reshape(s.shape)
            raw[s.name] = chunk
        tensors[s.name] = t
    dest = Destinations(header, device, tensors, raw, whole=whole, base=base, apart=apart)
    dest.host = {n: r.numpy().data for n, r in raw.items()}
    return dest


MADV_POPULATE_READ = 22
"""madvise(2), Linux 5.14+: map every page of a range readable, as if each were read,
without breaking copy-on-write (the flag Python's mmap module names only from 3.13)."""


def map_resident(header: Header, path: Path) -> Destinations | None:
    """CPU destinations that are the file's own pages: a private (copy-on-write) mapping of
    the whole file with every page mapped before this returns (``MADV_POPULATE_READ``),
    tensors are views of it. No byte is copied; the pages are the page cache's, shared
    with every other process that maps or holds the file, and a tensor written in place
    gets private copies of the pages it writes.

    None (the caller reads the file instead) when a tensor is misaligned for its dtype
    or the kernel cannot populate a mapping this way."""
    import mmap

    import torch

    dtypes = _dtypes_of(header)
    if header.file_size == 0 or not all(
        _aligned(s, header.data_offset + s.begin) for s in header.tensors
    ):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != header.file_size:
            raise ObjectChanged(f"{path} changed size while it was loaded")
        mapped = mmap.mmap(
            fd, header.file_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    finally:
        os.close(fd)
    try:
        mapped.madvise(MADV_POPULATE_READ)
    except OSError:  # an older kernel: EINVAL
        mapped.close()
        return None
    whole = torch.frombuffer(mapped, dtype=torch.uint8)  # the tensor keeps the mapping alive
    tensors, raw = {}, {}
    for s in header.tensors:
        lo = header.data_offset + s.begin
        chunk = whole[lo : lo + s.nbytes]
        tensors[s.name] = chunk.view(dtypes[s.dtype]).reshape(s.shape)
        raw[s.name] = chunk
    cpu = torch.device("cpu")
    return Destinations(header, cpu, tensors, raw, whole=whole, base=0, mapping=mapped)


def _aligned_host_buffer(nbytes: int) -> torch.Tensor:
    import torch

    # 2 MiB aligned, huge pages asked for; each chunk is faulted in by its reader, unless
    # a standby process faulted this memory in ahead (``pagecache.RESERVE``).
    size = max(nbytes, PAGE)
    view = RESERVE.take(size) or host_buffer(size)
    return torch.frombuffer(view, dtype=torch.uint8)[:nbytes]


def into(
    header: Header, targets: Mapping[str, torch.Tensor], *, subset: bool = False
) -> Destinations:
    """Destinations that are the caller's tensors (names, shapes and dtypes must match).
    ``subset``: the file is one shard of several; it fills the targets its tensors name
    (every one of them must have one)."""
    import torch

    dtypes = torch_dtypes()
    names = {s.name for s in header.tensors}
    if subset:
        targets = {n: t for n, t in targets.items() if n in names}
    missing, unexpected = sorted(set(targets) - names), sorted(names - set(targets))
    if missing or unexpected:
        raise LoaderError(
            f"artifact and destination disagree: missing from the artifact {missing[:5]}, "
            f"not in the destination {unexpected[:5]}",
            missing=missing, unexpected=unexpected,
        )  # fmt: skip
    devices = {t.device for t in targets.values()}
    if len(devices) > 1:
        on = sorted(map(str, devices))
        raise LoaderError(f"destination tensors are on several devices: {on}")
    for s in header.tensors:
        t = targets[s.name]
        if s.dtype not in dtypes or t.dtype != dtypes[s.dtype] or tuple(t.shape) != s.shape:
            raise LoaderError(
                f"tensor {s.name!r}: artifact has {s.dtype}{list(s.shape)}, destination "
                f"has {t.dtype}{list(t.shape)}"
            )
        if not t.is_contiguous():
            raise LoaderError(f"tensor {s.name!r}: destination is not contiguous")
    device = next(iter(devices)) if devices else torch.device("cpu")
    raw = {n: _byte_alias(t) for n, t in targets.items()}
    dest = Destinations(header, device, dict(targets), raw)
    if device.type == "cpu":
        dest.host = {n: r.numpy().data for n, r in raw.items() if r.numel()}
    return dest


# --- the plan shared by both sources -------------------------------------------------
class _Plan:
    """Which tensors a file range covers, and how many ranges each tensor still waits for."""

    def __init__(self, header: Header) -> None:
        self.header = header
        self.specs = header.tensors
        self.begins = [s.begin for s in self.specs]
        self.pending: dict[str, int] = {}
        self.lock = threading.Lock()

    def overlaps(self, lo: int, hi: int) -> Iterator[tuple[TensorSpec, int, int]]:
        """Tensors overlapping data-section bytes ``[lo, hi)``: (spec, from, to)."""
        i = max(0, bisect.bisect_right(self.begins, lo) - 1)
        while i < len(self.specs) and self.specs[i].begin < hi:
            s = self.specs[i]
            a, b = max(lo, s.begin), min(hi, s.end)
            if a < b:
                yield s, a, b
            i += 1

    def count(self, ranges: list[tuple[int, int]]) -> list[str]:
        """Register the ranges that will arrive; returns the tensors already complete."""
        for lo, hi in ranges:
            for s, _, _ in self.overlaps(lo, hi):
                self.pending[s.name] = self.pending.get(s.name, 0) + 1
        return [s.name for s in self.specs if s.name not in self.pending]

    def arrived(self, lo: int, hi: int) -> list[str]:
        done = []
        with self.lock:
            for s, _, _ in self.overlaps(lo, hi):
                self.pending[s.name] -= 1
                if self.pending[s.name] == 0:
                    done.append(s.name)
        return done


Done = Callable[[list[str]], None]


# --- local file ----------------------------------------------------------------------
class FilePlacement:
    """Read a local safetensors file's data section into ``dest`` with parallel workers."""

    def __init__(
        self,
        path: Path,
        dest: Destinations,
        *,
        threads: int,
        chunk_bytes: int,
        staging_bytes: int,
        direct_io: bool,
    ) -> None:
        self.path, self.dest, self.header = path, dest, dest.header
        self.chunk = max(DIRECT_ALIGN, _align_down(chunk_bytes))
        self.threads, self.staging_bytes, self.direct_io = threads, staging_bytes, direct_io
        self.plan = _Plan(self.header)
        start = dest.base if dest.whole is not None else _align_down(self.header.data_offset)
        self.chunks = [
            (lo, min(lo + self.chunk, self.header.file_size))
            for lo in range(start, self.header.file_size, self.chunk)
        ]
        self.bytes_direct = 0
        self.bytes_buffered = 0
        self._resident: bytearray | None = None
        self._resident_lock = threading.Lock()

    def _data_range(self, lo: int, hi: int) -> tuple[int, int]:
        off = self.header.data_offset
        return max(lo, off) - off, max(hi, off) - off

    def run(self, done: Done) -> None:
        """Place every tensor; ``done(names)`` is called (from any thread) as they land."""
        done(self.plan.count([self._data_range(lo, hi) for lo, hi in self.chunks]))
        if not self.chunks:
            return
        fd = os.open(self.path, os.O_RDONLY)
        dfd = open_direct(self.path) if self.direct_io else None
        pool = None
        if self.dest.whole is None:
            pool = staging_pool(self.dest.device, self.staging_bytes, self.chunk)
        try:
            if os.fstat(fd).st_size != self.header.file_size:
                raise ObjectChanged(f"{self.path} changed size while it was loaded")
            next_index = iter(range(len(self.chunks)))
            take = threading.Lock()

            def worker() -> None:
                streams = _Worker(self, fd, dfd, pool, done)
                try:
                    while True:
                        with take:
                            i = next(next_index, None)
                        if i is None:
                            return
                        streams.place(*self.chunks[i])
                finally:
                    streams.finish()

            workers = max(1, min(self.threads, len(self.chunks)))
            if pool is not None:
                workers = max(1, min(workers, len(pool.slots) // self._slots_per_worker()))
            with ThreadPoolExecutor(workers, thread_name_prefix="ember-place") as ex:
                futures = [submit_in_context(ex, worker) for _ in range(workers)]
                for fut in futures:
                    fut.result()
        finally:
            os.close(fd)
            if dfd is not None:
                os.close(dfd)

    def _slots_per_worker(self) -> int:
        return 2 if self.dest.device.type == "cuda" else 1

    def resident(self, fd: int, lo: int, hi: int) -> bool:
        """Whether file bytes ``[lo, hi)`` are all in the page cache: ``cachestat`` for
        the chunk, else ``mincore`` over the whole file, asked once per load."""
        first, last = lo // PAGE, -(-hi // PAGE)
        cached = cached_pages(fd, first * PAGE, (last - first) * PAGE)
        if cached is not None:
            return cached >= last - first
        with self._resident_lock:
            if self._resident is None:
                self._resident = resident_pages(self.path)
        return 0 not in self._resident[first:last].translate(MINCORE_BIT0)


class _Worker:
    """One placement thread: its slots, its CUDA stream, and copies not yet confirmed.

    A chunk the page cache holds whole is read through it (one kernel copy per byte);
    any other chunk with ``O_DIRECT`` (a DMA into huge-page memory, no page-cache copy).
    ``RWF_NOWAIT`` reads were tried for "the cached prefix, then O_DIRECT": they start
    readahead of the missing pages, so a cold chunk was read from the disk twice.
    """

    def __init__(
        self,
        owner: FilePlacement,
        fd: int,
        dfd: int | None,
        pool: StagingPool | None,
        done: Done,
    ) -> None:
        import torch

        self.o, self.fd, self.dfd, self.pool, self.done = owner, fd, dfd, pool, done
        self.cuda = owner.dest.device.type == "cuda"
        self.stream = torch.cuda.Stream(owner.dest.device) if self.cuda else None  # type: ignore[no-untyped-call]
        # CUDA: (event, slot, data range) of copies in flight, confirmed before slot reuse.
        self.inflight: list[tuple[Any, int, tuple[int, int]]] = []

    def place(self, lo: int, hi: int) -> None:
        o = self.o
        use_direct = self.dfd is not None and not o.resident(self.fd, lo, hi)
        if o.dest.whole is not None:
            self._read_whole(lo, hi, use_direct)
            self._arrived(lo, hi)
        elif not self.cuda and not use_direct:
            self._read_into_host(lo, hi)
            self._arrived(lo, hi)
        else:
            self._read_staged(lo, hi, use_direct)

    def _arrived(self, lo: int, hi: int) -> None:
        names = self.o.plan.arrived(*self.o._data_range(lo, hi))
        if names:
            self.done(names)

    def _read(self, fd: int, bufs: list[memoryview], offset: int, expect: int) -> None:
        got = 0
        while got < expect:
            n = os.preadv(fd, bufs, offset + got)
            if n <= 0:
                raise ArtifactError(f"{self.o.path}: truncated at byte {offset + got}")
            got += n
            if got < expect:
                bufs = _advance(bufs, n)

    def _read_any(self, target: memoryview, lo: int, hi: int, use_direct: bool) -> None:
        """[lo, hi) into an aligned target: O_DIRECT (length rounded up to 4 KiB) or
        through the page cache."""
        if use_direct:
            assert self.dfd is not None
            try:
                n = os.preadv(self.dfd, [target[: _align_up(hi - lo)]], lo)
            except OSError:  # the filesystem refused this O_DIRECT read: read it buffered
                n = 0
            else:
                self.o.bytes_direct += min(n, hi - lo)
            if n >= hi - lo:
                return
            lo, target = lo + n, target[n:]  # short: finish through the page cache
        self._read(self.fd, [target[: hi - lo]], lo, hi - lo)
        self.o.bytes_buffered += hi - lo

    def _read_whole(self, lo: int, hi: int, use_direct: bool) -> None:
        whole = self.o.dest.whole
        assert whole is not None
        base = self.o.dest.base
        # Fault the fresh pages in with one call (several times faster than letting the
        # read fault them one by one); ctypes drops the GIL, so workers do it in parallel.
        populate_range(whole.data_ptr() + lo - base, _align_up(hi - lo))
        self._read_any(whole.numpy().data[lo - base :], lo, hi, use_direct)
        if self.o.dest.apart:  # misaligned tensors: their bytes, out of the buffer
            off = self.o.header.data_offset
            for s, a, b in self.o.plan.overlaps(*self.o._data_range(lo, hi)):
                if s.name in self.o.dest.apart:
                    src = whole[off + a - base : off + b - base]
                    self.o.dest.raw[s.name][a - s.begin : b - s.begin].copy_(src)

    def _read_into_host(self, lo: int, hi: int) -> None:
        """Cached chunk, CPU destinations: one preadv straight into the tensors."""
        off = self.o.header.data_offset
        d0, d1 = self.o._data_range(lo, hi)
        bufs = [
            self.o.dest.host[s.name][a - s.begin : b - s.begin]
            for s, a, b in self.o.plan.overlaps(d0, d1)
        ]
        if bufs:
            self._read(self.fd, bufs, off + d0, d1 - d0)
        self.o.bytes_buffered += d1 - d0

    def _read_staged(self, lo: int, hi: int, use_direct: bool) -> None:
        pool = self.pool
        assert pool is not None
        slot_index = pool.acquire()
        slot = pool.slots[slot_index]
        try:
            self._read_any(slot.numpy().data, lo, hi, use_direct)
            data = self.o._data_range(lo, hi)
            _copy_out(self.o.plan, self.o.dest, slot, lo - self.o.header.data_offset, data,
                      self.stream)  # fmt: skip
        except BaseException:
            pool.release(slot_index)
            raise
        if not self.cuda:
            pool.release(slot_index)
            self._arrived(lo, hi)
            return
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        self.inflight.append((event, slot_index, (lo, hi)))
        while len(self.inflight) >= 2:  # keep one copy in flight while the next read runs
            self._confirm_oldest()

    def _confirm_oldest(self) -> None:
        assert self.pool is not None
        event, slot_index, (lo, hi) = self.inflight.pop(0)
        event.synchronize()
        self.pool.release(slot_index)
        self._arrived(lo, hi)

    def finish(self) -> None:
        while self.inflight:
            self._confirm_oldest()


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:])
        n = 0
    return out


def _copy_out(
    plan: _Plan,
    dest: Destinations,
    src: torch.Tensor,
    src_data_offset: int,
    data_range: tuple[int, int],
    stream: Any,
) -> None:
    """Copy data-section bytes ``data_range`` from ``src`` (whose byte 0 is data-section
    offset ``src_data_offset``) into their destinations (non_blocking on ``stream``)."""
    import torch

    if stream is None and dest.device.type == "cpu":
        # Host to host: a plain memmove. ctypes drops the GIL for it (workers copy in
        # parallel) and, unlike torch's copy_, it wakes no OpenMP pool that spins.
        base = src.data_ptr() - src_data_offset
        for s, a, b in plan.overlaps(*data_range):
            ctypes.memmove(dest.raw[s.name].data_ptr() + a - s.begin, base + a, b - a)
        return
    ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
    with ctx:
        for s, a, b in plan.overlaps(*data_range):
            dst = dest.raw[s.name][a - s.begin : b - s.begin]
            dst.copy_(src[a - src_data_offset : b - src_data_offset], non_blocking=True)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# --- stream of chunks (cache fill) ---------------------------------------------------
class StreamPlacement:
    """Place a safetensors object arriving as ordered ``(offset, bytes)`` chunks.

    The header is collected from the first chunks, then destinations are made (``alloc``
    builds them from the header) and every later byte is copied into place: a CPU
    destination directly, a CUDA one through a pinned slot with a ``non_blocking`` copy.
    """

    def __init__(
        self,
        make_dest: Callable[[Header], Destinations],
        parse: Callable[[bytes, int], Header | None],
        file_size: int,
        done: Done,
        staging: Callable[[Any], StagingPool],
    ) -> None:
        self.make_dest, self.parse, self.file_size, self.done = make_dest, parse, file_size, done
        self.staging = staging
        self.head = bytearray()
        self.dest: Destinations | None = None
        self.plan: _Plan | None = None
        self.next_offset = 0
        self.stream: Any = None

    def feed(self, offset: int, chunk: memoryview) -> None:
        if offset != self.next_offset:
            raise LoaderError(f"chunks out of order: got {offset}, expected {self.next_offset}")
        self.next_offset += len(chunk)
        if self.dest is None:
            self.head += chunk
            if len(self.head) < PREFIX_BYTES:
                return
            header = self.parse(bytes(self.head), self.file_size)  # None until complete
            if header is None:
                return
            self._start(header)
            rest = memoryview(bytes(self.head))[header.data_offset :]
            self.head = bytearray()
            if rest:
                self._place(header.data_offset, rest)
            return
        self._place(offset, chunk)

    def _start(self, header: Header) -> None:
        self.dest = self.make_dest(header)
        self.plan = _Plan(header)
        # Chunks arrive in order and exactly once: count bytes left per tensor.
        self.left = {s.name: s.nbytes for s in header.tensors}
        ready = [s.name for s in header.tensors if s.nbytes == 0]
        if self.dest.device.type == "cuda":
            import torch

            self.stream = torch.cuda.Stream(self.dest.device)  # type: ignore[no-untyped-call]
        if ready:
            self.done(ready)

    def _place(self, offset: int, chunk: memoryview) -> None:
        assert self.dest is not None and self.plan is not None
        d0 = offset - self.dest.header.data_offset
        d1 = d0 + len(chunk)
        if self.dest.device.type == "cuda":
            pool = self.staging(self.dest.device)
            for start in range(0, len(chunk), pool.slot_bytes):
                piece = chunk[start : start + pool.slot_bytes]
                i = pool.acquire()
                try:
                    pool.slots[i][: len(piece)].numpy()[:] = piece
                    _copy_out(self.plan, self.dest, pool.slots[i], d0 + start,
                              (d0 + start, d0 + start + len(piece)), self.stream)  # fmt: skip
                    self.stream.synchronize()
                finally:
                    pool.release(i)
        else:
            # CPU: a plain memcpy into the destination's bytes (the chunk is read-only,
            # which torch.frombuffer would warn about).
            for s, a, b in self.plan.overlaps(d0, d1):
                self.dest.host[s.name][a - s.begin : b - s.begin] = chunk[a - d0 : b - d0]
        finished = []
        for s, a, b in self.plan.overlaps(d0, d1):
            self.left[s.name] -= b - a
            if self.left[s.name] == 0:
                finished.append(s.name)
        if finished:
            self.done(finished)
