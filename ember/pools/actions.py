"""What the pools controller does to replicas: every side effect on a replica, through the
``ReplicaBackend`` (launch, stop, kill) and the replicas' control endpoints
(:class:`~ember.pools.replica_control.ReplicaControl`), with the replica's state changed,
the routing table republished and an event recorded for each.

Starting one (a standby process assigned when one can take it, else a cold launch),
changing its tier, draining and stopping it, failing and replacing it, promoting a
``starting`` one that answers ``/info`` ready, probing idle ones through ``/healthz``,
reaping exited processes and keeping the standby pool full. The controller decides
(:func:`~ember.pools.plan.plan`, the autoscalers) and this carries it out, so the
reconcile loop reads as decisions and the side effects are read in one place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.domain.spec import STANDBY_POOL, DeploymentKey, ReplicaState, Source, Tier, VersionSpec
from ember.loader.pagecache import whole_huge_pages
from ember.logs import get_logger, model_context
from ember.pools.backends.base import LaunchOptions, ReplicaBackend
from ember.pools.inventory import ManagedReplica, ReplicaInventory
from ember.pools.replica_control import ReplicaControl
from ember.serving.router import Route

if TYPE_CHECKING:
    from ember.pools.learners import PromotionLearner, StandbySizer
    from ember.pools.metrics import PoolMetrics
    from ember.pools.plan import Actions
    from ember.pools.warmtier import SharedWarmTier
    from ember.serving.routing import DeploymentView, RoutingTable

log = get_logger(__name__)

EVENTS_KEPT = 200
"""The most recent replica events kept (the deployment's listing shows them)."""


@dataclass(frozen=True)
class ProbeSettings:
    """How idle replicas are probed (``/healthz``) and when one is given up."""

    idle_s: float = 5.0
    """Probe a ready replica that completed no request for this long."""
    timeout_s: float = 2.0
    failures: int = 2
    """Consecutive failed probes before the replica is killed and replaced."""


class ReplicaActions:
    """The side effects on the controller's replicas (``replicas``), each published to
    the routing table (``table``) and recorded in ``events``."""

    def __init__(
        self,
        backend: ReplicaBackend,
        replicas: ReplicaInventory,
        table: RoutingTable,
        metrics: PoolMetrics,
        *,
        standby: StandbySizer,
        promotion: PromotionLearner,
        probe: ProbeSettings,
        woken: dict[tuple[DeploymentKey, str], float],
        idle_hold_s: float,
        leading: Callable[[], bool],
        warm_tier: SharedWarmTier | None = None,
        standby_reserve_max: int = 0,
    ) -> None:
        self.backend = backend
        self.replicas = replicas
        self.table = table
        self.metrics = metrics
        self.standby = standby
        """Sized by the starts that ask it for a process and the spawn times seen here."""
        self.promotion = promotion
        """Learns how long each way of becoming hot takes (what the autoscaler leads by)."""
        self.probe = probe
        self.woken = woken
        """The controller's scale-to-zero wake-ups: a woken version's replica, once ready,
        holds it ``idle_hold_s`` longer, so the wake-up is served before it scales."""
        self.idle_hold_s = idle_hold_s
        self.leading = leading
        """Whether the controller acts now: a follower forgets a failed replica, kills none."""
        self.warm_tier = warm_tier
        self.standby_reserve_max = standby_reserve_max
        """Host memory a standby process faults in ahead, at most (``_standby_reserve``)."""
        self.replica_api = ReplicaControl.with_timeout(probe.timeout_s)
        """The replicas' control endpoints (``/info``, ``/healthz``, ``/tier``, ``/assign``)."""
        self.events: list[dict[str, Any]] = []
        self.failures: dict[tuple[DeploymentKey, str], int] = {}
        """Failures per version since one of its replicas came ready (``max_restarts`` of
        them: a crash loop, the controller starts no more)."""
        self._assigning: set[asyncio.Task[None]] = set()
        """Tier changes, assignments and drains in flight (cancelled on losing the lease)."""

    def publish(self) -> None:
        """Publish the routing table (:class:`~ember.serving.routing.RoutingTable`) from the
        replicas (:meth:`~ember.pools.inventory.ReplicaInventory.lanes`). Called after every
        change of what is routable, so a request never scans the replicas."""
        self.table.publish(self.replicas.lanes(), tracked=self.replicas.routes())

    def cancel(self) -> None:
        """Stop what is in flight (the lease is lost: another controller may act already)."""
        for task in list(self._assigning):
            task.cancel()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._assigning.add(task)
        task.add_done_callback(self._assigning.discard)

    # --- events and failures ------------------------------------------------------------

    def event(self, kind: str, replica: ManagedReplica, **fields: Any) -> None:
        event = {
            "event": kind,
            "replica_id": replica.handle.replica_id,
            "model": replica.model,
            "version": replica.version,
            "tenant_id": replica.key.tenant_id,
            "deployment": replica.key.name,
            "at": time.time(),
            **fields,
        }
        self.events = [*self.events[1 - EVENTS_KEPT :], event]
        with model_context(replica.model, replica.version, replica_id=replica.handle.replica_id):
            log.info(f"replica {kind}", **fields)

    def fail(self, replica: ManagedReplica, reason: str) -> None:
        replica.state, replica.reason = ReplicaState.failed, reason
        if self.leading():  # a follower only forgets it; the acting controller replaces it
            self.backend.kill(replica.handle)  # nothing to drain, a hung one gets no grace
        self.replicas.pop(replica.handle.replica_id, None)
        if not replica.key.standby_pool:
            key = (replica.key, replica.version)
            self.failures[key] = self.failures.get(key, 0) + 1
        self.publish()
        self.event("failed", replica, reason=reason)

    def reap_exited(self) -> None:
        for replica in list(self.replicas.values()):
            if (
                replica.state is ReplicaState.draining
            ):  # being stopped: its exit is the plan, no failure
                continue
            status = self.backend.exited(replica.handle)
            if status is not None:
                self.metrics.replaced.labels(*self.metrics.of_replica(replica), "exited").inc()
                reason = self.backend.exit_reason(replica.handle)
                self.fail(replica, reason or f"process exited with status {status}")

    # --- readiness and probes -----------------------------------------------------------

    async def check_starting(self) -> None:
        starting = [r for r in self.replicas.values() if r.state is ReplicaState.starting]
        for replica in starting:
            self._note_queued(replica)
        await asyncio.gather(*(self.check_one(r) for r in starting if r.queued is None))

    def _note_queued(self, replica: ManagedReplica) -> None:
        """Whether the backend still holds the replica back (its state says why); its
        start time is when it leaves the queue, so a cold start's figure is its own."""
        waiting = self.backend.waiting(replica.handle)
        if waiting is not None and replica.queued is None:
            self.event("queued", replica, reason=waiting)
        elif waiting is None and replica.queued is not None:
            replica.started_at = time.monotonic()
            self.event("dequeued", replica, pid=replica.handle.pid, port=replica.handle.port)
        replica.queued = waiting

    async def check_one(self, replica: ManagedReplica) -> None:
        info = await self.replica_api.info(replica.handle)
        if info is None:
            return  # not listening yet
        if info.get("state") == "failed":
            self.fail(replica, info.get("failure") or "load failed")
            return
        spare = replica.key.standby_pool
        want = ReplicaState.standby if spare else ReplicaState.ready
        if replica.adopted and not spare and info.get("state") == want:
            replica.tier = Tier(info.get("tier") or Tier.hot)  # a warm one stays warm
        if info.get("state") == want and (spare or info.get("tier") == replica.tier):
            replica.state = want
            replica.ready_at = time.monotonic()
            replica.last_ok = replica.ready_at
            if spare and not replica.adopted:
                spawn = replica.ready_at - replica.started_at
                self.standby.spawned(spawn)
            if (replica.key, replica.version) in self.woken:  # serve the wake-up, then scale
                self.woken[(replica.key, replica.version)] = replica.ready_at + self.idle_hold_s
            if not spare and replica.tier is Tier.hot and replica.then_tier is Tier.warm:
                replica.then_tier = None  # a warm spare: loaded, now demoted (not routed)
                self.change_tier(replica, Tier.warm)
            elif not spare and replica.tier is Tier.hot:
                replica.route = Route(
                    replica.handle.replica_id, replica.handle.url, replica.version,
                    secret=replica.handle.secret,
                )  # fmt: skip
            if not spare and not replica.adopted:
                took = replica.ready_at - replica.started_at
                self.metrics.cold_start.labels(*self.metrics.of_replica(replica)).observe(took)
                self.promotion.record(replica.source, took)
                self.failures.pop((replica.key, replica.version), None)
            self.publish()
            self.event("ready", replica, startup_s=round(replica.ready_at - replica.started_at, 3),
                       load=(info.get("load_report") or {}).get("stages"))  # fmt: skip

    async def probe_idle(self) -> None:
        now = time.monotonic()
        idle = [
            r
            for r in self.replicas.values()
            if r.state in (ReplicaState.ready, ReplicaState.standby)
            and now - r.last_ok >= self.probe.idle_s
        ]
        await asyncio.gather(*(self._probe_one(r) for r in idle))

    async def _probe_one(self, replica: ManagedReplica) -> None:
        if await self.replica_api.healthy(replica.handle):
            replica.probe_failures, replica.last_ok = 0, time.monotonic()
            return
        replica.probe_failures += 1
        if replica.probe_failures >= self.probe.failures:
            detected = time.monotonic() - replica.last_ok
            labels = self.metrics.of_replica(replica)
            self.metrics.detect_seconds.labels(*labels).observe(detected)
            self.metrics.replaced.labels(*labels, "probe").inc()
            self.fail(replica, f"failed {replica.probe_failures} health probes")
            self.event("killed", replica, detected_after_s=round(detected, 3))

    # --- a version's plan, carried out --------------------------------------------------

    def act(
        self, view: DeploymentView | None, key: DeploymentKey, version: str, todo: Actions
    ) -> None:
        """A version's :class:`~ember.pools.plan.Actions`, carried out: which replicas move
        is chosen here (the least loaded, then the newest, steps down first); nothing
        starts for a deployment deleted (``view`` None) or a version it no longer has."""
        mine = self.replicas.of(key, version)

        def least_busy(rs: list[ManagedReplica]) -> list[ManagedReplica]:
            return sorted(
                rs,
                key=lambda r: (self.table.inflight_units(r.handle.replica_id), -r.started_at),
            )

        hot = least_busy(self.replicas.ready(key, version, Tier.hot))
        warm = least_busy(self.replicas.ready(key, version, Tier.warm))
        loading = [r for r in mine if r.state is ReplicaState.starting and r.then_tier is Tier.warm]
        for replica in warm[: todo.promote]:
            self.change_tier(replica, Tier.hot)
        for replica in loading[: todo.keep_hot]:
            replica.then_tier = None
        if view is not None and version in view.specs:
            for _ in range(todo.start_hot):
                self.start(view, version)
            for _ in range(todo.start_warm):
                self.start(view, version, then_tier=Tier.warm)
        for replica in hot[: todo.demote]:
            self.change_tier(replica, Tier.warm)
        stops = hot[todo.demote : todo.demote + todo.stop_hot]
        stops += warm[todo.promote : todo.promote + todo.stop_warm]
        # Warm spares still loading first, the newest (the last to be ready) first.
        on_the_way = sorted(
            (
                r
                for r in mine
                if r.state in (ReplicaState.starting, ReplicaState.promoting, ReplicaState.demoting)
            ),
            key=lambda r: (
                r.then_tier is not Tier.warm or r.state is not ReplicaState.starting,
                -r.started_at,
            ),
        )
        stops += on_the_way[: todo.stop_starting]
        starts = [r for r in mine if r.state is ReplicaState.starting and r.then_tier is None]
        stops += sorted(starts, key=lambda r: -r.started_at)[: todo.cancel_hot]
        for replica in stops:
            self.stop(replica)

    # --- tiers --------------------------------------------------------------------------

    def change_tier(self, replica: ManagedReplica, tier: Tier) -> None:
        replica.state = ReplicaState.promoting if tier is Tier.hot else ReplicaState.demoting
        self.publish()
        self._spawn(self._set_tier(replica, tier))

    async def _set_tier(self, replica: ManagedReplica, tier: Tier) -> None:
        started = time.monotonic()
        if not await self.replica_api.set_tier(replica.handle, tier):
            self.fail(replica, f"tier change to {tier} failed")
            return
        replica.state, replica.tier, replica.last_ok = ReplicaState.ready, tier, time.monotonic()
        self.publish()
        if tier is Tier.hot:
            self.promotion.record(Source.warm, time.monotonic() - started)
        self.event("tier", replica, tier=tier, seconds=round(time.monotonic() - started, 3))

    # --- starting -----------------------------------------------------------------------

    def start(self, view: DeploymentView, version: str, *, then_tier: Tier | None = None) -> None:
        spec = view.specs[version]
        options = LaunchOptions(
            view.policy.max_batch_size,
            view.policy.max_queue_delay_ms,
            tenant_id=view.tenant_id,
            deployment=view.name,
            placement=view.policy.placement,
        )
        self._standby_asked()
        standby = next(
            (
                r
                for r in self.replicas.standby_ready()
                if self.backend.standby_can_take(r.handle, spec, options)
            ),
            None,
        )
        if standby is not None:
            self.backend.assigned(standby.handle, spec, options)
            del self.replicas[standby.handle.replica_id]
            # A version the shared warm tier holds loads from host RAM: a warm promotion.
            held = self.warm_tier is not None and self.warm_tier.holds(
                view.model, version, spec.sha256
            )
            replica = ManagedReplica(
                standby.handle,
                view.key,
                view.model,
                version,
                source=Source.warm if held else Source.standby,
                then_tier=then_tier,
            )
            self.replicas[replica.handle.replica_id] = replica
            self._spawn(self._assign(replica, spec, options))
            self.event(
                "assigned", replica, from_tier=Tier.standby, then_tier=then_tier, warm_set=held
            )
            return
        handle = self.backend.launch(spec, options)
        replica = ManagedReplica(
            handle,
            view.key,
            view.model,
            version,
            then_tier=then_tier,
        )
        self.replicas[handle.replica_id] = replica
        self.event("starting", replica, pid=handle.pid, port=handle.port, then_tier=then_tier)

    async def _assign(
        self, replica: ManagedReplica, spec: VersionSpec, options: LaunchOptions
    ) -> None:
        """Give the standby process its version and the deployment's batch policy and
        threads (it was started with the defaults, before anyone knew its deployment)."""
        params = options.replica_settings()
        params |= self.backend.assign_query(replica.handle, spec, options)
        await self.replica_api.assign(replica.handle, spec, params)

    def _standby_asked(self) -> None:
        """A start asks the shared standby pool for a process, found or not: the pool is
        sized from those asks with the simulator's own rule (``size_standby_pool``: one more
        than the most asked for within one refill time, the refill time learned here),
        between the floor and the maximum (:class:`~ember.pools.learners.StandbySizer`)."""
        grown = self.standby.asked(time.monotonic())
        if grown is not None:
            event = {"event": "standby_pool", "size": grown.size, "peak_asks": grown.peak_asks,
                     "refill_s": round(grown.refill_s, 3), "tenant_id": 0, "deployment": "",
                     "at": time.time()}  # fmt: skip
            self.events = [*self.events[1 - EVENTS_KEPT :], event]
            log.info("standby pool grown", size=grown.size, peak_asks=grown.peak_asks)

    def keep_standby(self, wanted: int, views: Iterable[DeploymentView]) -> None:
        """Launch the standby processes missing from ``wanted``, each faulting in the
        memory for the largest version of ``views`` it may be given (``_standby_reserve``)."""
        missing = wanted - len(self.replicas.spares())
        if missing <= 0:
            return
        options = LaunchOptions(reserve_bytes=self._standby_reserve(views))
        for _ in range(missing):
            handle = self.backend.launch(None, options)
            replica = ManagedReplica(handle, STANDBY_POOL, "", "", tier=Tier.standby)
            self.replicas[handle.replica_id] = replica
            self.event("starting", replica, standby=True, pid=handle.pid)

    def _standby_reserve(self, views: Iterable[DeploymentView]) -> int:
        """The memory a new standby process faults in for the weights it may be given: the
        largest version served that a standby process can become and that fits in
        ``standby_reserve_max``, rounded up to whole huge pages; 0 for none."""
        sizes = [
            whole_huge_pages(size)
            for view in views
            for version, size in view.sizes.items()
            if version in view.specs and self.backend.standby_can_run(view.specs[version])
        ]
        return max((n for n in sizes if n <= self.standby_reserve_max), default=0)

    # --- stopping -----------------------------------------------------------------------

    def stop(self, replica: ManagedReplica) -> None:
        replica.state = ReplicaState.draining
        self.publish()
        self.event("draining", replica)
        self._spawn(self._drain(replica))

    async def _drain(self, replica: ManagedReplica, wait_s: float = 30.0) -> None:
        deadline = time.monotonic() + wait_s
        rid = replica.handle.replica_id
        while self.table.inflight_units(rid) > 0 and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a counter the serving side owns
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.backend.stop, replica.handle)
        self.replicas.pop(rid, None)
        self.publish()
        self.event("stopped", replica)
