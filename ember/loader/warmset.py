"""The shared warm tier: the weights of many versions held in host RAM, no process each.

A warm replica costs a whole process per model. For a catalogue of rarely used models the
pools controller instead keeps their NVMe cache files in the page cache, mapped and
``mlock``-ed (``pagecache.PinnedFile``), within a byte budget (``EMBER_WARM_SET_BYTES``).
Promoting such a model is a standby process (runtime imported, shared by every model)
being assigned the version: the loader finds the file resident and maps it (copy-on-write
views of the page cache, ``device.map_resident``) instead of reading it — host RAM
standing in for a warm replica's copy, shared by the catalogue. (Measured on the 2-core
dev machine, 1 GiB model, request to first answer: 0.12 s held, 0.82 s from the disk.)

Each held entry is also pinned in the weight cache, so the cache's LRU cannot evict a
file the warm set holds. Torch-free (the control plane runs it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ember.loader.cache import CacheKey, Pin, WeightCache
from ember.loader.pagecache import PinnedFile
from ember.logs import get_logger, model_context

log = get_logger(__name__)


@dataclass
class Held:
    key: CacheKey
    size: int
    file: PinnedFile
    pin: Pin
    since: float
    seconds: float
    """How long reading it in took."""


class WarmSet:
    """Cache entries held resident in host RAM, most wanted first, within ``max_bytes``."""

    def __init__(self, cache: WeightCache, max_bytes: int, *, lock: bool = True) -> None:
        self.cache = cache
        self.max_bytes = max_bytes
        self.lock = lock
        self.held: dict[CacheKey, Held] = {}
        self._mutex = threading.Lock()

    @property
    def bytes_held(self) -> int:
        return sum(h.size for h in self.held.values())

    def sync(self, wanted: Iterable[CacheKey]) -> list[CacheKey]:
        """Hold ``wanted`` (most wanted first) as far as the budget goes and release every
        other entry. An entry that is not (completely) in the weight cache is skipped: fill
        it first (``WeightLoader.warm``). Returns the keys held afterwards. Blocking (a new
        entry is read in): call it off the event loop."""
        with self._mutex:
            keep: list[CacheKey] = []
            total = 0
            for key in dict.fromkeys(wanted):
                held = self.held.get(key)
                size = held.size if held else self._cached_size(key)
                if size is None or total + size > self.max_bytes:
                    continue  # not cached yet, or over budget (a smaller one may still fit)
                keep.append(key)
                total += size
            for key in [k for k in self.held if k not in keep]:
                self._release(key, "no longer wanted warm")
            for key in keep:
                if key not in self.held:
                    self._hold(key)
            return [k for k in keep if k in self.held]

    def refresh(self) -> int:
        """Read back pages the kernel evicted from entries it would not let us lock."""
        with self._mutex:
            return sum(h.file.refresh() for h in self.held.values())

    def close(self) -> None:
        with self._mutex:
            for key in list(self.held):
                self._release(key, "shutting down")

    def info(self) -> list[dict[str, Any]]:
        return [
            {"model": h.key.model, "version": h.key.version, "sha256": h.key.sha256,
             "bytes": h.size, "locked": h.file.locked, "since": h.since}
            for h in self.held.values()
        ]  # fmt: skip

    # --- internals ---------------------------------------------------------------------

    def _cached_size(self, key: CacheKey) -> int | None:
        path = self.cache.lookup(key)
        if path is None:
            return None
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return None

    def _hold(self, key: CacheKey) -> None:
        with model_context(key.model, key.version):
            pin = self.cache.pin(key)
            try:
                path = self.cache.lookup(key)  # under the pin: it cannot be evicted now
                if path is None:
                    pin.release()
                    return
                started = time.perf_counter()
                file = PinnedFile(path, lock=self.lock)
            except BaseException:
                pin.release()
                raise
            seconds = time.perf_counter() - started
            self.held[key] = Held(key, file.size, file, pin, time.time(), seconds)
            log.info(
                "weights held warm",
                sha256=key.sha256,
                bytes=file.size,
                seconds=round(seconds, 3),
                locked=file.locked,
                lock_error=file.lock_error,
                warm_set_bytes=self.bytes_held,
            )

    def _release(self, key: CacheKey, why: str) -> None:
        held = self.held.pop(key)
        held.file.close()
        held.pin.release()
        with model_context(key.model, key.version):
            log.info("weights released from the warm set", sha256=key.sha256, reason=why,
                     bytes=held.size, held_s=round(time.time() - held.since, 1))  # fmt: skip
