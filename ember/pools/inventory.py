"""The pools controller's replica inventory: every replica it tracks, with its typed state
(:class:`~ember.domain.spec.ReplicaState`, :class:`~ember.domain.spec.Tier`,
:class:`~ember.domain.spec.Source`), and the questions the controller, the metrics and
the dashboard ask of them — a version's replicas by state (the
:class:`~ember.pools.plan.Inventory` a plan counts), the standby pool, and the routing
table's lanes, which are a function of the replicas alone.

The controller's actions (:mod:`~ember.pools.actions`) change the replicas; what is asked
of them is here, one pass each, so the reconcile loop reads as what it does rather than how
it counts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ember.domain.spec import STANDBY_POOL, DeploymentKey, ReplicaState, Source, Tier
from ember.pools.backends.base import ObservedReplica, ReplicaHandle
from ember.pools.plan import Inventory
from ember.serving.router import Route
from ember.serving.routing import Lane, LaneKey


@dataclass
class ManagedReplica:
    handle: ReplicaHandle
    key: DeploymentKey
    """Its deployment; :data:`~ember.domain.spec.STANDBY_POOL` for a standby process."""
    model: str
    version: str
    state: ReplicaState = ReplicaState.starting
    tier: Tier = Tier.hot
    reason: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    last_ok: float = field(default_factory=time.monotonic)
    probe_failures: int = 0
    route: Route | None = None
    replaces: str | None = None
    detected_after_s: float | None = None
    adopted: bool = False
    """Found running (a follower's view, or taken over on election), not launched here."""
    source: Source = Source.cold
    """How it was started: ``cold`` (a new process), ``standby`` (a standby one assigned) or
    ``warm`` (a standby one assigned a version the shared warm tier holds)."""
    then_tier: Tier | None = None
    """``warm``: a warm spare started from nothing, demoted to warm once loaded."""
    queued: str | None = None
    """Why the backend has not started it yet (waiting for GPUs): ``starting`` to the
    controller (counted as on its way), ``queued`` with this reason in its listing."""

    def __post_init__(self) -> None:  # plain values (tests, the backend's records): typed
        self.key = DeploymentKey(*self.key)
        self.state, self.tier = ReplicaState(self.state), Tier(self.tier)
        self.source = Source(self.source)
        self.then_tier = None if self.then_tier is None else Tier(self.then_tier)

    @property
    def ready_in(self) -> Tier | None:
        """The tier it serves from, ready (``hot``, ``warm``); ``None`` while it is not."""
        return self.tier if self.state is ReplicaState.ready else None

    @property
    def coming_hot(self) -> bool:
        """On its way to hot: being promoted, or starting to be hot (not a warm spare)."""
        return self.state is ReplicaState.promoting or (
            self.state is ReplicaState.starting and self.then_tier is None
        )

    def public(self, inflight_units: float = 0.0) -> dict[str, Any]:
        return {
            "replica_id": self.handle.replica_id,
            "model": self.model,
            "version": self.version,
            "state": ReplicaState.queued if self.queued else self.state,
            "tier": self.tier,
            "reason": self.queued or self.reason,
            "pid": self.handle.pid,
            "port": self.handle.port,
            "url": self.handle.url,
            "inflight_units": inflight_units,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
        }


class ReplicaInventory(dict[str, ManagedReplica]):
    """The tracked replicas by replica id, and what is asked of them."""

    def track(self, observed: list[ObservedReplica], *, prune: bool) -> None:
        """Track replicas found in the backend (``starting`` until ``/info`` tells their
        state: a follower's view, or what an elected controller adopts); with ``prune``,
        forget tracked ones that are no longer there."""
        seen = set()
        for o in observed:
            seen.add(o.handle.replica_id)
            if o.handle.replica_id not in self:
                key = DeploymentKey(o.tenant_id, o.deployment) if o.deployment else STANDBY_POOL
                tier = Tier.standby if key.standby_pool else Tier.hot
                replica = ManagedReplica(o.handle, key, o.model, o.version, tier=tier)
                replica.adopted = True
                self[o.handle.replica_id] = replica
        if prune:
            for replica_id in set(self) - seen:
                self.pop(replica_id)

    def of(
        self, key: DeploymentKey | tuple[int, str], version: str | None = None
    ) -> list[ManagedReplica]:
        """A deployment's replicas, or one version's."""
        return [
            r for r in self.values() if r.key == key and (version is None or r.version == version)
        ]

    def ready(self, key: DeploymentKey, version: str, tier: Tier) -> list[ManagedReplica]:
        """The version's replicas ready in ``tier``."""
        return [r for r in self.of(key, version) if r.ready_in is tier]

    def inventory(self, key: DeploymentKey, version: str) -> Inventory:
        """The version's replicas by state, as :func:`~ember.pools.plan.plan` counts them."""
        mine = self.of(key, version)
        return Inventory(
            hot=sum(1 for r in mine if r.ready_in is Tier.hot),
            warm=sum(1 for r in mine if r.ready_in is Tier.warm),
            starting_hot=sum(1 for r in mine if r.coming_hot),
            promoting=sum(1 for r in mine if r.state is ReplicaState.promoting),
            starting_warm=sum(
                1 for r in mine if r.state is ReplicaState.starting and r.then_tier is Tier.warm
            ),
            demoting=sum(1 for r in mine if r.state is ReplicaState.demoting),
        )

    def standby_ready(self) -> list[ManagedReplica]:
        """The standby processes ready to be assigned a version."""
        return [r for r in self.values() if r.state is ReplicaState.standby]

    def spares(self) -> list[ManagedReplica]:
        """The standby pool's processes, ready or not (they count against its size)."""
        return [r for r in self.values() if r.key.standby_pool]

    def deployments(self) -> set[DeploymentKey]:
        """The deployments that have replicas (the standby pool is none)."""
        return {r.key for r in self.values() if not r.key.standby_pool}

    def hot_versions(self, key: DeploymentKey) -> set[str]:
        """The deployment's versions with a ready hot replica."""
        return {r.version for r in self.of(key) if r.ready_in is Tier.hot}

    def lanes(self) -> dict[LaneKey, Lane]:
        """The routing table's lanes: per (deployment, version) the routes of its ready hot
        replicas, and whether a hot one is on its way (starting, assigned, being promoted,
        or a warm one the autoscaler promotes on demand). One pass over the replicas, so a
        request never scans them."""
        routes: dict[LaneKey, list[Route]] = {}
        coming: set[LaneKey] = set()
        for r in self.values():
            if r.key.standby_pool:
                continue
            lane = (r.key, r.version)
            if r.ready_in is Tier.hot and r.route is not None:
                routes.setdefault(lane, []).append(r.route)
            elif r.state in (ReplicaState.starting, ReplicaState.promoting) or (
                r.ready_in is Tier.warm
            ):
                coming.add(lane)
        return {k: Lane(tuple(routes.get(k, ())), k in coming) for k in routes.keys() | coming}

    def routes(self) -> Iterator[Route]:
        """Every replica's route (the table tracks their in-flight units)."""
        return (r.route for r in self.values() if r.route is not None)
