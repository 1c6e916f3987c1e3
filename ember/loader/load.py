"""The loader's front door: artifact URI -> NVMe cache -> tensors on the device.

An engine loads one model version with::

    loader = WeightLoader(settings)
    weights = loader.load("bert", "3", uri, sha256, device="cuda:0")   # or into=params
    model.load_state_dict(weights.tensors)    # or pass into=module_destinations(model)
    ...                                        # serve
    weights.pin.release()                      # when the replica stops (lets LRU evict)

or iterates ``loader.stream(...)`` to get ``(name, tensor)`` pairs while the rest of the
file is still arriving. A directory version (a manifest of files, ``VersionSpec.directory``)
loads with ``loader.load_version(spec)`` / ``stream_version(spec)``: every file is an entry
of its own keyed by the manifest (``CacheKey.manifest``), pinned together; its shards
stream ``EMBER_LOADER_SHARDS_IN_FLIGHT`` at a time through the same pipeline, each a
single-flight, verified fill (or a hit), and the other files (config, tokenizer) are filled
beside them; ``loader.files_dir(spec)`` is the version's directory made of those verified
entries. On a cache miss the object store's bytes go to the cache file
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.config import Settings
from ember.domain.manifest import Manifest
from ember.domain.safetensors import PREFIX_BYTES, Header, parse_header, read_header_len
from ember.errors import ArtifactError, LoaderError
from ember.loader.cache import CacheKey, FillResult, Pin, WeightCache
from ember.loader.pagecache import RESERVE, PinnedFile, fully_resident
from ember.loader.report import CacheOutcome, LoadReport
from ember.loader.stores import ObjectInfo, ObjectStore, join_uri, open_store
from ember.logs import model_context

if TYPE_CHECKING:
    import torch

    from ember.domain.spec import VersionSpec
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
        self._where: dict[str, Destinations] = {}
        self._where_lock = threading.Lock()
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

    def _started(self, dest: Destinations, source: str = "") -> None:
        """``dest`` holds the tensors of one file (of several, for a sharded version)."""
        with self._where_lock:
            for spec in dest.header.tensors:
                if spec.name in self._where:
                    raise ArtifactError(
                        f"tensor {spec.name!r} is in two shards (the second: {source})",
                        tensor=spec.name[:200],
                    )
            for spec in dest.header.tensors:
                self._where[spec.name] = dest

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
            for name in event:
                tensor = self._where[name].tensors[name]
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

    def stream_version(
        self, spec: VersionSpec, *, device: str = "cpu", into: Targets | None = None
    ) -> WeightStream:
        """The weights of ``spec``: one file, or every shard of a directory version."""
        manifest = spec.manifest
        if manifest is None:
            return self.stream(spec.model, spec.version, spec.artifact_uri, spec.sha256,
                               device=device, into=into)  # fmt: skip

        def run(ws: WeightStream) -> None:
            with model_context(spec.model, spec.version):
                self._load_manifest(ws, spec, manifest, device, into)

        return WeightStream(run)

    def load_version(
        self, spec: VersionSpec, *, device: str = "cpu", into: Targets | None = None
    ) -> LoadedWeights:
        """``stream_version`` to the end: every tensor on the device and verified."""
        return self.stream_version(spec, device=device, into=into).result()

    def warm_version(self, spec: VersionSpec) -> None:
        """Fill every file of ``spec`` into the cache without loading it."""
        manifest = spec.manifest
        if manifest is None:
            self.warm(spec.model, spec.version, spec.artifact_uri, spec.sha256)
            return
        with model_context(spec.model, spec.version):
            keys = _file_keys(spec, manifest)
            with ThreadPoolExecutor(self.settings.loader_shards_in_flight,
                                    thread_name_prefix="ember-fill") as pool:  # fmt: skip
                for _ in pool.map(lambda path: self._ensure(spec, manifest, path, keys[path]),
                                  list(keys)):  # fmt: skip
                    pass

    def files_dir(self, spec: VersionSpec) -> Path:
        """A directory version's files but its weights (config, tokenizer, index, ...),
        filled and verified, as a directory of links (``WeightCache.tree``): what the
        transformers and vLLM engines read beside the weights. Pinned for the life of the
        loader's process (they are small)."""
        manifest = spec.manifest
        if manifest is None:
            raise ArtifactError(f"{spec.model}:{spec.version} is not a directory version")
        with model_context(spec.model, spec.version):
            keys = _file_keys(spec, manifest)
            weights = {f.path for f in manifest.shards}
            side = {path: key for path, key in keys.items() if path not in weights}
            if not side:
                raise ArtifactError("the version has no file beside its weights (config.json)")
            for path, key in side.items():
                _KEEP.append(self.cache.pin(key))
                self._ensure(spec, manifest, path, key)
            return self.cache.tree(side)

    def _ensure(self, spec: VersionSpec, manifest: Manifest, path: str, key: CacheKey) -> None:
        """The file's entry filled and verified (single-flight)."""
        uri = spec.artifact_uri
        self._fill_once(key, uri, lambda store: _file_info(store, uri, manifest, path))

    def _load_manifest(
        self,
        ws: WeightStream,
        spec: VersionSpec,
        manifest: Manifest,
        device: str,
        into: Targets | None,
    ) -> None:
        started = time.perf_counter()
        keys = _file_keys(spec, manifest)
        pins: list[Pin] = []
        try:
            for key in dict.fromkeys(keys.values()):
                pins.append(self.cache.pin(key))
        except BaseException:
            for pin in pins:
                pin.release()
            raise
        ws.pin = Pin.joined(pins, CacheKey(spec.model, spec.version, manifest.digest))
        report = LoadReport(spec.model, spec.version, spec.artifact_uri, manifest.digest,
                            device, "hit")  # fmt: skip
        shards = [f.path for f in manifest.shards]
        others = [path for path in keys if path not in shards]
        reports: list[LoadReport] = []
        ctx = contextvars.copy_context()

        def one(path: str) -> None:
            try:
                if path in others:
                    self._ensure(spec, manifest, path, keys[path])
                    return
                part = LoadReport(spec.model, spec.version, path, keys[path].sha256, device,
                                  "hit")  # fmt: skip
                uri = join_uri(spec.artifact_uri, *path.split("/"))
                size = manifest.files_by_path[path].size
                self._place_entry(ws, keys[path], uri, device, into, part, size, subset=True)
                reports.append(part)
            except LoaderError as exc:
                if exc.detail.startswith(path):
                    raise
                raise type(exc)(f"{path}: {exc.detail}", **{**exc.extra, "file": path}) from exc

        workers = self.settings.loader_shards_in_flight
        with ThreadPoolExecutor(workers, thread_name_prefix="ember-shard") as pool:
            futures = [pool.submit(ctx.copy().run, one, path) for path in shards + others]
            try:
                for fut in futures:
                    fut.result()
            finally:
                for fut in futures:
                    fut.cancel()
        if into is not None:
            missing = sorted(set(into) - set(ws._where))
            if missing:
                raise LoaderError(
                    f"destination tensors not in any shard: {missing[:5]}", missing=missing[:50]
                )
        _merge(report, reports)
        report.stage("total", report.bytes, time.perf_counter() - started)
        ws.report = report
        report.log()

    def warm(self, model: str, version: str, uri: str, sha256: str) -> FillResult | None:
        """Fill the cache entry without loading it (``None``: it was already there)."""
        with model_context(model, version):
            return self._fill_once(CacheKey(model, version, sha256), uri, lambda s: s.stat(uri))

    def _fill_once(
        self, key: CacheKey, uri: str, info: Callable[[ObjectStore], ObjectInfo]
    ) -> FillResult | None:
        """Fill ``key`` from the object ``info`` stats, single-flight across threads and
        processes, unless it is (verified) there already (``None``)."""
        if self.cache.lookup(key) is not None:
            return None
        with self.cache.fill_lock(key):
            if self.cache.checked(key) is not None:
                return None
            store = open_store(uri, self.settings)
            return self.cache.fill(key, store, info(store))

    def _load(
        self, ws: WeightStream, key: CacheKey, uri: str, device: str, into: Targets | None
    ) -> None:
        started = time.perf_counter()
        ws.pin = self.cache.pin(key)
        report = LoadReport(key.model, key.version, uri, key.sha256, device, "hit")
        self._place_entry(ws, key, uri, device, into, report)
        report.stage("total", report.bytes, time.perf_counter() - started)
        ws.report = report
        report.log()

    def _place_entry(
        self,
        ws: WeightStream,
        key: CacheKey,
        uri: str,
        device: str,
        into: Targets | None,
        report: LoadReport,
        expect_size: int | None = None,
        *,
        subset: bool = False,
    ) -> None:
        """One safetensors file's entry onto the device: placed from the cache on a hit,
        else fetched into the cache and placed as its bytes arrive. ``subset``: the file
        fills the part of ``into`` its tensors name (one shard of several)."""
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
                    self._fill_and_place(ws, key, uri, device, into, report, outcome,
                                         expect_size, subset)  # fmt: skip
        if path is not None:
            place_file(path, device=device, into=into, settings=self.settings, ws=ws,
                       report=report, subset=subset)  # fmt: skip

    def _fill_and_place(
        self,
        ws: WeightStream,
        key: CacheKey,
        uri: str,
        device: str,
        into: Targets | None,
        report: LoadReport,
        outcome: CacheOutcome,
        expect_size: int | None = None,
        subset: bool = False,
    ) -> None:
        import torch

        from ember.loader import device as dev

        target = torch.device(device)
        max_header = self.settings.artifact_max_header_bytes

        def make_dest(header: Header) -> Destinations:
            dest = (
                dev.into(header, into, subset=subset)
                if into is not None
                else dev.allocate(header, target, whole_file=False)
            )
            ws._started(dest, uri)
            return dest

        store = open_store(uri, self.settings)
        info = store.stat(uri)
        if expect_size is not None and info.size != expect_size:
            raise ArtifactError(
                f"{uri} is {info.size} bytes, its manifest says {expect_size}: the object "
                "changed since the version was registered"
            )
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
    subset: bool = False,
) -> dict[str, torch.Tensor]:
    """Place a local safetensors file on ``device`` (or into ``into``, or with ``subset``
    into the part of ``into`` its tensors name); returns the tensors."""
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
            dev.into(header, into, subset=subset)
            if into is not None
            else dev.allocate(header, target, whole_file=True)
        )
    done = ws._done if ws is not None else lambda names: None
    if ws is not None:
        ws._started(dest, str(path))
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


_KEEP: list[Pin] = []
"""Pins of the files ``files_dir`` linked: held for the life of the process."""

_OUTCOME_RANK = ("hit", "verified-hit", "resumed", "refetched", "miss")


def _file_keys(spec: VersionSpec, manifest: Manifest) -> dict[str, CacheKey]:
    """Each file's cache entry: keyed by model, version, its sha256 and the manifest."""
    return {
        f.path: CacheKey(spec.model, spec.version, f.sha256, manifest=manifest.digest)
        for f in manifest.files
    }


def _file_info(store: ObjectStore, base: str, manifest: Manifest, path: str) -> ObjectInfo:
    uri = join_uri(base, *path.split("/"))
    info = store.stat(uri)
    entry = manifest.files_by_path.get(path)
    if entry is None or info.size != entry.size:
        raise ArtifactError(
            f"{path} is {info.size} bytes in the store, its manifest says "
            f"{entry.size if entry else 'nothing'}: the object changed since the version was "
            "registered",
            file=path,
        )
    return info


def _merge(report: LoadReport, parts: list[LoadReport]) -> None:
    """A directory version's report from its shards' (loaded several at once): bytes
    summed; a stage's seconds the longest shard's (not their sum: they overlap); the cache
    outcome the worst of theirs."""
    report.bytes = sum(p.bytes for p in parts)
    report.tensors = sum(p.tensors for p in parts)
    report.bytes_fetched = sum(p.bytes_fetched for p in parts)
    outcomes: list[CacheOutcome] = [p.cache for p in parts] or ["hit"]
    report.cache = max(outcomes, key=_rank)
    stages: dict[str, list[float]] = {}
    for part in parts:
        for stage in part.stages:
            acc = stages.setdefault(stage.name, [0, 0.0])
            acc[0] += stage.bytes
            acc[1] = max(acc[1], stage.seconds)
    for name, (nbytes, seconds) in stages.items():
        report.stage(name, int(nbytes), seconds)


def _rank(outcome: CacheOutcome) -> int:
    return _OUTCOME_RANK.index(outcome) if outcome in _OUTCOME_RANK else 0
