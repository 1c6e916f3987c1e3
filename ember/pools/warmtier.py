"""The pools controller's side of the shared warm tier (``ember.loader.warmset``).

Every few seconds it decides which versions the warm set holds: every routable version
(production, canary) with no ready hot or warm replica of its own — a catalogue model
scaled to zero, one waiting for a standby, a canary not started yet — most recently
requested first, as far as ``EMBER_WARM_SET_BYTES`` goes. A version that has a ready
replica is let go (its weights are in that process already). A standby process assigned a
held version then reads it from host RAM; the controller records such a start as a
promotion from the warm tier, so the autoscaler's lead for it is what it really takes.

Only for the local process backend: the warm set is this host's page cache, and the
replicas must read the same NVMe cache.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge

from ember.domain.manifest import is_shard
from ember.domain.spec import ReplicaState, Tier, VersionSpec
from ember.loader.cache import CacheKey, WeightCache
from ember.loader.warmset import WarmSet
from ember.logs import get_logger

if TYPE_CHECKING:
    from ember.config import Settings
    from ember.domain.spec import DeploymentKey
    from ember.pools.inventory import ManagedReplica
    from ember.serving.routing import DeploymentView

    Deployments = Mapping[DeploymentKey, DeploymentView]
    """The controller's deployments, read from the registry."""
    Replicas = Mapping[str, ManagedReplica]
    """The controller's replicas by replica id (its ``ReplicaInventory``)."""

log = get_logger(__name__)
Key = tuple[tuple[int, str], str]
"""(tenant id, deployment), version"""


class SharedWarmTier:
    def __init__(self, warm_set: WarmSet, *, every_s: float = 2.0) -> None:
        self.warm_set = warm_set
        self.every_s = every_s
        self.last_demand: dict[Key, float] = {}
        self.held: frozenset[tuple[str, str, str]] = frozenset()
        """(model, version, sha256) held whole after the last sync (read on the event
        loop); a directory version's sha256 is its manifest's, held when all its shards are."""
        self._shards: dict[tuple[str, str, str], int] = {}
        """Entries each wanted version needs held (a directory version: its shards)."""
        self._last = -math.inf
        self._task: asyncio.Task[list[CacheKey]] | None = None
        self._bytes: Gauge | None = None
        self._versions: Gauge | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> SharedWarmTier | None:
        if settings.warm_set_bytes <= 0:
            return None
        return cls(WarmSet(WeightCache.from_settings(settings), settings.warm_set_bytes))

    def register_metrics(self, registry: CollectorRegistry) -> None:
        self._bytes = Gauge(
            "ember_warm_set_bytes", "Bytes of weights the shared warm tier holds in host RAM.",
            registry=registry,
        )  # fmt: skip
        self._versions = Gauge(
            "ember_warm_set_versions", "Versions the shared warm tier holds in host RAM.",
            registry=registry,
        )  # fmt: skip

    def demanded(self, key: tuple[int, str], version: str) -> None:
        """A request arrived for the version (the gateway's hot path: one dict write)."""
        self.last_demand[(key, version)] = time.monotonic()

    def holds(self, model: str, version: str, sha256: str) -> bool:
        return (model, version, sha256) in self.held

    def wanted(self, deployments: Deployments, replicas: Replicas) -> list[CacheKey]:
        """Routable versions of ``deployments`` with no ready hot or warm replica among
        ``replicas``, most recently requested first (never requested: last, in the
        registry's order)."""
        live = {
            (r.key, r.version)
            for r in replicas.values()
            if r.state is ReplicaState.ready and r.tier in (Tier.hot, Tier.warm)
        }
        ranked: list[tuple[float, int, CacheKey]] = []
        shards: dict[tuple[str, str, str], int] = {}
        for key, view in deployments.items():
            for version, weight in view.traffic.items():
                spec = view.specs.get(version)
                sha256 = spec.sha256 if spec is not None else ""
                if spec is None or weight <= 0 or (key, version) in live or len(sha256) != 64:
                    continue
                last = self.last_demand.get((key, version), -math.inf)
                keys = _weight_keys(view.model, version, sha256, key.tenant_id, spec)
                shards[(view.model, version, sha256)] = len(keys)
                ranked += [(-last, len(ranked) + i, k) for i, k in enumerate(keys)]
        self._shards = shards
        return [k for _, _, k in sorted(ranked)]

    def tick(self, deployments: Deployments, replicas: Replicas) -> None:
        """Start a sync in a thread when one is due and none is running (reading a newly
        held version in takes a buffered read of it; the control loop does not wait)."""
        if self._task is not None:
            if not self._task.done():
                return
            self._finish(self._task)
            self._task = None
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        wanted = self.wanted(deployments, replicas)
        self._task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(self._sync, wanted), name="ember-warm-set"
        )

    def _sync(self, wanted: Iterable[CacheKey]) -> list[CacheKey]:
        held = self.warm_set.sync(wanted)
        self.warm_set.refresh()
        return held

    def _finish(self, task: asyncio.Task[list[CacheKey]]) -> None:
        try:
            keys = task.result()
        except Exception:  # a bad sync must not stop the controller; the next one retries
            log.exception("warm set sync failed")
            return
        self.record(keys)

    def record(self, keys: list[CacheKey]) -> None:
        """What the last sync holds: a version counts as held when all its entries are."""
        counts: dict[tuple[str, str, str], int] = {}
        for k in keys:
            ident = (k.model, k.version, k.manifest or k.sha256)
            counts[ident] = counts.get(ident, 0) + 1
        self.held = frozenset(i for i, n in counts.items() if n >= self._shards.get(i, 1))
        if self._bytes is not None and self._versions is not None:
            self._bytes.set(self.warm_set.bytes_held)
            self._versions.set(len(self.held))

    async def close(self) -> None:
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.to_thread(self.warm_set.close)


def _weight_keys(
    model: str, version: str, sha256: str, tenant: int, spec: VersionSpec
) -> list[CacheKey]:
    """The cache entries of a version's weights: its one file, or a directory version's
    top-level shards (``ember.domain.manifest``), keyed by the manifest."""
    if not spec.directory or spec.files is None:
        return [CacheKey(model, version, sha256, tenant)]
    return [
        CacheKey(model, version, f.sha256, tenant, sha256)
        for f in spec.files
        if is_shard(f.path) and "/" not in f.path
    ]
