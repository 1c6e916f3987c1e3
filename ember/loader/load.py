"""The loader's front door: artifact URI -> NVMe cache -> tensors on the device.

An engine loads one model version with::

    loader = WeightLoader(settings)
    weights = loader.load("bert", "3", uri, sha256, device="cuda:0")   # or into=params
    model.load_state_dict(weights.tensors)    # or pass into=module_destinations(model)
    ...                                        # serve
    weights.pin.release()                      # when the replica stops (lets LRU evict)

or iterates ``loader.stream(...)`` to get ``(name, tensor)`` pairs while the rest of the
file is still arriving. On a cache miss the object store's bytes go to the cache file
and the device in one pass; on a hit the cache file goes to the device. The load is
complete — and verified — only when the stream is exhausted without an error (on a miss
the sha256 is known only after the last byte).

Imports torch lazily (through ``ember.loader.device``); importing this module does not.
"""

from __future__ import annotations

import contextvars
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.config import Settings
from ember.errors import ArtifactError
from ember.loader.cache import CacheKey, FillResult, Pin, WeightCache
from ember.loader.pagecache import RESERVE, PinnedFile, fully_resident
from ember.loader.report import CacheOutcome, LoadReport
from ember.loader.safetensors import PREFIX_BYTES, Header, parse_header, read_header_len
from ember.loader.stores import open_store
from ember.logs import model_context

if TYPE_CHECKING:
    import torch

    from ember.loader.device import Destinations

Targets = Mapping[str, "torch.Tensor"]


@dataclass(slots=True)
class LoadedWeights:
    tensors: dict[str, torch.Tensor]
    report: LoadReport
    pin: Pin | None
    """Keeps the cache entry from eviction; release it when the replica stops."""


class WeightStream:
    """``(name, tensor)`` pairs in the order their bytes land; ``report`` at the end.

    Iterate it to the end: a tensor handed out is fully on the device, but the load as
    a whole is verified only when iteration ends without raising.
    """

    def __init__(self, run: Callable[[WeightStream], None]) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.report: LoadReport | None = None
        self.pin: Pin | None = None
        self._dest: Destinations | None = None
        self._events: queue.SimpleQueue[list[str] | BaseException | None] = queue.SimpleQueue()
        ctx = contextvars.copy_context()
        self._thread = threading.Thread(
            target=ctx.run, args=(self._drive, run), name="ember-load", daemon=True
        )
        self._thread.start()

    def _drive(self, run: Callable[[WeightStream], None]) -> None:
        try:
            run(self)
        except BaseException as exc:  # handed to the consumer, re-raised there
            self._events.put(exc)
        else:
            self._events.put(None)

    def _started(self, dest: Destinations) -> None:
        self._dest = dest

    def _done(self, names: list[str]) -> None:
        self._events.put(names)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            event = self._events.get()
            if event is None:
                self._thread.join()
                return
            if isinstance(event, BaseException):
                self._thread.join()
                if self.pin is not None:
                    self.pin.release()
                raise event
            assert self._dest is not None
            for name in event:
                tensor = self._dest.tensors[name]
                self.tensors[name] = tensor
                yield name, tensor

    def result(self) -> LoadedWeights:
        for _ in self:
            pass
        assert self.report is not None
        return LoadedWeights(self.tensors, self.report, self.pin)


class WeightLoader:
    """Loads model versions through the NVMe cache. Thread-safe; one per process."""

    def __init__(self, settings: Settings, cache: WeightCache | None = None) -> None:
        self.settings = settings
        self.cache = cache or WeightCache.from_settings(settings)

    def stream(
        self,
        model: str,
        version: str,
        uri: str,
        sha256: str,
        *,
        device: str = "cpu",
        into: Targets | None = None,
    ) -> WeightStream:
        key = CacheKey(model, version, sha256)

        def run(ws: WeightStream) -> None:
            with model_context(model, version):
                self._load(ws, key, uri, device, into)

        return WeightStream(run)

    def load(
        self,
        model: str,
        version: str,
        uri: str,
        sha256: str,
        *,
        device: str = "cpu",
        into: Targets | None = None,
    ) -> LoadedWeights:
        """Load every tensor; returns once all bytes are on the device and verified."""
        return self.stream(model, version, uri, sha256, device=device, into=into).result()

    def warm(self, model: str, version: str, uri: str, sha256: str) -> FillResult | None:
        """Fill the cache entry without loading it (``None``: it was already there)."""
        key = CacheKey(model, version, sha256)
        with model_context(model, version):
            if self.cache.lookup(key) is not None:
                return None
            with self.cache.fill_lock(key):
                if self.cache.checked(key) is not None:
                    return None
                store = open_store(uri, self.settings)
                return self.cache.fill(key, store, store.stat(uri))

    def _load(
        self, ws: WeightStream, key: CacheKey, uri: str, device: str, into: Targets | None
    ) -> None:
        started = time.perf_counter()
        ws.pin = self.cache.pin(key)
        report = LoadReport(key.model, key.version, uri, key.sha256, device, "hit")
        path = self.cache.lookup(key)
        if path is None:
            # Present but not usable without a re-hash (due), versus absent (fill, or wait
            # for the thread or process already filling it).
            had_entry = self.cache.weights_path(key).exists()
            with self.cache.fill_lock(key):
                t0 = time.perf_counter()
                path = self.cache.checked(key)
                if path is not None:  # another filler finished, or a due re-hash passed
                    report.cache = "verified-hit" if had_entry else "hit"
                    if time.perf_counter() - t0 > 0.01:
                        report.stage("verify", path.stat().st_size, time.perf_counter() - t0)
                else:
                    outcome: CacheOutcome = "refetched" if had_entry else "miss"
                    self._fill_and_place(ws, key, uri, device, into, report, outcome)
        if path is not None:
            place_file(path, device=device, into=into, settings=self.settings, ws=ws,
                       report=report)  # fmt: skip
        report.stage("total", report.bytes, time.perf_counter() - started)
        ws.report = report
        report.log()

    def _fill_and_place(
        self,
        ws: WeightStream,
        key: CacheKey,
        uri: str,
        device: str,
        into: Targets | None,
        report: LoadReport,
        outcome: CacheOutcome,
    ) -> None:
        import torch

        from ember.loader import device as dev

        target = torch.device(device)
        max_header = self.settings.artifact_max_header_bytes

        def make_dest(header: Header) -> Destinations:
            dest = (
                dev.into(header, into)
                if into is not None
                else dev.allocate(header, target, whole_file=False)
            )
            ws._started(dest)
            return dest

        store = open_store(uri, self.settings)
        info = store.stat(uri)
        placement = dev.StreamPlacement(
            make_dest, lambda head, size: _header_when_complete(head, size, max_header),
            info.size, ws._done,
            lambda d: dev.staging_pool(d, self.settings.loader_staging_bytes,
                                       self.settings.loader_chunk_bytes),
        )  # fmt: skip
        t0 = time.perf_counter()
        result = self.cache.fill(key, store, info, sink=placement.feed)
        if placement.dest is None:
            raise ArtifactError(f"{uri}: the object ended before its safetensors header")
        report.cache = "resumed" if result.bytes_resumed else outcome
        report.bytes_fetched = result.bytes_fetched
        report.bytes = placement.dest.header.data_len
        report.tensors = len(placement.dest.header.tensors)
        report.stage("fetch", info.size, time.perf_counter() - t0)


def _header_when_complete(head: bytes, file_size: int, max_header: int) -> Header | None:
    header_len = read_header_len(head[:PREFIX_BYTES], file_size, max_header)
    if len(head) < PREFIX_BYTES + header_len:
        return None
    return parse_header(head[PREFIX_BYTES : PREFIX_BYTES + header_len], file_size)


def read_header(path: Path, max_header_bytes: int) -> Header:
    """Parse a local file's header defensively (bounded before anything is allocated)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        header_len = read_header_len(os.pread(fd, PREFIX_BYTES, 0), size, max_header_bytes)
        raw = os.pread(fd, header_len, PREFIX_BYTES)
        if len(raw) != header_len:
            raise ArtifactError(f"{path}: truncated inside the safetensors header")
        return parse_header(raw, size)
    finally:
        os.close(fd)


def place_file(
    path: Path,
    *,
    device: str = "cpu",
    into: Targets | None = None,
    settings: Settings,
    ws: WeightStream | None = None,
    report: LoadReport | None = None,
) -> dict[str, torch.Tensor]:
    """Place a local safetensors file on ``device`` (or into ``into``); returns the tensors."""
    import torch

    from ember.loader import device as dev

    t0 = time.perf_counter()
    header = read_header(path, settings.artifact_max_header_bytes)
    target = torch.device(device)
    dest = None
    if into is None and target.type == "cpu" and settings.loader_map_resident:
        dest = _map_if_resident(header, path)  # every byte there already: nothing to place
    mapped = dest is not None
    if dest is None:
        dest = (
            dev.into(header, into)
            if into is not None
            else dev.allocate(header, target, whole_file=True)
        )
    done = ws._done if ws is not None else lambda names: None
    if ws is not None:
        ws._started(dest)
    if mapped:
        done([s.name for s in header.tensors])
    else:
        placement = dev.FilePlacement(
            path, dest, threads=settings.loader_threads, chunk_bytes=settings.loader_chunk_bytes,
            staging_bytes=settings.loader_staging_bytes, direct_io=settings.loader_direct_io,
        )  # fmt: skip
        placement.run(done)
    if report is not None:
        report.bytes, report.tensors = header.data_len, len(header.tensors)
        report.stage("map" if mapped else "place", header.data_len, time.perf_counter() - t0)
    return dest.tensors


def _map_if_resident(header: Header, path: Path) -> Destinations | None:
    """The file mapped (``device.map_resident``) when the page cache holds all of it, its
    pages then locked in the page cache for as long as the mapping lives (``_Hold``)."""
    from ember.loader import device as dev

    if not fully_resident(path):
        return None
    dest = dev.map_resident(header, path)
    if dest is not None:
        RESERVE.release()  # a standby process's memory for the weights: not needed now
    if dest is not None and dest.mapping is not None:
        hold = _Hold(path)
        weakref.finalize(dest.mapping, hold.close)
        threading.Thread(target=hold.pin, name="ember-pin", daemon=True).start()
    return dest


class _Hold:
    """Mapped weights are page-cache pages, which the kernel may reclaim when they are not
    used for a while (memory pressure, a proactive reclaim daemon such as DAMON): an idle
    replica would then read its weights from the disk again on its next request. This
    holds them with ``pagecache.PinnedFile`` (a shared read-only mapping, ``mlock``-ed: no
    copy-on-write is broken), from just after the load until the mapping is freed. Pinning
    takes ~0.15 s per GiB, so it runs in a thread, off the load's path. Where the process
    may not lock memory, nothing is held."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pinned: PinnedFile | None = None
        self.closed = False
        self.lock = threading.Lock()

    def pin(self) -> None:
        try:
            pinned = PinnedFile(self.path)
        except OSError:
            return
        with self.lock:
            if self.closed or not pinned.locked:
                pinned.close()
            else:
                self.pinned = pinned

    def close(self) -> None:
        with self.lock:
            self.closed = True
            if self.pinned is not None:
                self.pinned.close()
                self.pinned = None


def load_file(
    path: Path | str,
    *,
    device: str = "cpu",
    into: Targets | None = None,
    settings: Settings | None = None,
) -> LoadedWeights:
    """Load a local safetensors file without the cache (tools, tests, the bench)."""
    settings = settings or Settings()
    started = time.perf_counter()
    report = LoadReport(None, None, str(path), None, device, "bypass")
    tensors = place_file(Path(path), device=device, into=into, settings=settings,
                         report=report)  # fmt: skip
    report.stage("total", report.bytes, time.perf_counter() - started)
    return LoadedWeights(tensors, report, None)


def module_destinations(module: Any) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers by state-dict name, as load destinations
    (``into=``): the weights land in the module's own memory, no state-dict copy."""
    import torch

    with torch.no_grad():
        return {name: t.detach() for name, t in module.state_dict(keep_vars=True).items()}
