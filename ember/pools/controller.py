"""The pools controller: a reconcile loop that keeps each deployment's replicas as they
should be, and the routing table the gateway reads.

Every tick it reads the deployments from the registry, reaps replicas whose process
exited, promotes ``starting`` replicas that answer ``/readyz``, probes idle ready
replicas through ``/healthz`` (killing and replacing those that stop answering), starts
what is missing (taking a standby process when one is ready), retires versions that no
longer get traffic once the new ones are ready, and keeps a small standby pool.
All process calls go through the ``ReplicaBackend``.

With a leader election (several API replicas on a cluster), only the elected controller
acts; the others follow — they keep the routing table from the replicas the backend
observes and change nothing. A newly elected controller adopts the replicas that exist
instead of starting its own.

This module is the loop that decides and acts; what it reads and asks is each its own
piece: the replicas and their typed state (``inventory``), the deployments read from the
registry (``registry_view``), the replicas' control endpoints (``replica_control``), the
autoscalers and their saved state (``scaling``) and what it learns (``learners``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.domain.spec import (
    STANDBY_POOL,
    DeploymentKey,
    ReplicaState,
    Source,
    Tier,
    VersionSpec,
)
from ember.errors import NotReady
from ember.loader.pagecache import whole_huge_pages
from ember.logs import get_logger, model_context
from ember.pools.autoscaler import Autoscaler, EmberConfig, EmberState, Observation, TierCounts
from ember.pools.backends.base import (
    LaunchOptions,
    ObservedReplica,
    ReplicaBackend,
)
from ember.pools.demand import DemandKey, ForecastStore, SharedDemand
from ember.pools.inventory import ManagedReplica, ReplicaInventory
from ember.pools.learners import PromotionLearner, StandbySizer
from ember.pools.metrics import PoolMetrics
from ember.pools.plan import (
    Actions,
    Inventory,
    Target,
    all_ready,
    hot_target,
    plan,
)
from ember.pools.registry_view import RegistryView
from ember.pools.replica_control import ReplicaControl
from ember.pools.scaling import Autoscalers
from ember.pools.warmtier import SharedWarmTier
from ember.serving.router import Route
from ember.serving.routing import DeploymentView, RoutingTable

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from ember.pools.history import History
    from ember.pools.leader import LeaseElection

log = get_logger(__name__)

WAKE_HOLD_S = 60.0
"""A woken scale-to-zero version is wanted hot this long while its replica starts."""


@dataclass(frozen=True)
class ProbeSettings:
    idle_s: float = 5.0
    """Probe a ready replica that completed no request for this long."""
    timeout_s: float = 2.0
    failures: int = 2
    """Consecutive failed probes before the replica is killed and replaced."""


class PoolsController:
    def __init__(
        self,
        db: Engine,
        backend: ReplicaBackend,
        *,
        standby_pool: int = 1,
        standby_max: int | None = None,
        probe: ProbeSettings | None = None,
        tick_s: float = 0.25,
        max_restarts: int = 3,
        leader: LeaseElection | None = None,
        autoscale: dict[str, Any] | None = None,
        fill_warm: bool = False,
        standby_reserve_max: int = 0,
        async_demand: Callable[[], dict[tuple[int, str], float]] | None = None,
        shared_demand: SharedDemand | None = None,
        forecast_store: ForecastStore | None = None,
        warm_tier: SharedWarmTier | None = None,
        history: History | None = None,
    ) -> None:
        self.standby_reserve_max = standby_reserve_max
        """Host memory a standby process faults in ahead, at most (``_standby_reserve``)."""
        self.backend = backend
        self.leader = leader
        self.leading = leader is None
        self._lease_checked = -math.inf
        self.standby = StandbySizer(standby_pool, standby_max)
        """The shared standby pool's size: the floor, grown by the starts that ask for one."""
        self.probe_settings = probe or ProbeSettings()
        self.tick_s = tick_s
        self.max_restarts = max_restarts
        self.replicas = ReplicaInventory()
        self.deployments: dict[DeploymentKey, DeploymentView] = {}
        self.failures: dict[tuple[DeploymentKey, str], int] = {}
        self.events: list[dict[str, Any]] = []
        self.table = RoutingTable()
        """What the serving side routes by (``publish``); it counts in-flight units there."""
        self.metrics = PoolMetrics()
        backend.register_metrics(self.metrics.registry)
        self.replica_api = ReplicaControl.with_timeout(self.probe_settings.timeout_s)
        """The replicas' control endpoints (``/info``, ``/healthz``, ``/tier``, ``/assign``)."""
        self._task: asyncio.Task[None] | None = None
        self._assigning: set[asyncio.Task[None]] = set()
        # The predictive autoscaler (the same code the simulator replays) per production
        # version, fed with what the gateway saw since the last step; its state (a learned
        # daily profile) in the forecast store (Redis), restored by whichever controller
        # acts next (restart, new leader).
        self.autoscalers = Autoscalers(autoscale, forecast_store)
        self.fill_warm = fill_warm
        """Start replicas into the warm tier when the autoscaler wants more warm ones than
        demoting hot ones gives. Off by default: on the local (CPU) backend a warm replica
        holds as much memory as a hot one."""
        # Scale-to-zero deployments woken by a request while they held no replica: the
        # version is wanted hot (at least one) until this monotonic time — a start's worth,
        # then, once ready, the idle hold — after which the autoscaler, having seen the
        # demand, decides.
        self.woken: dict[tuple[DeploymentKey, str], float] = {}
        self.registry = RegistryView(db)
        """Reads the deployments (when the registry changed) into ``deployments``."""
        # The job queue's hook (ember.jobs.demand): (tenant id, deployment) -> model units
        # of unfinished async jobs, read in a thread with the registry; added to the
        # production version's queued units, so a backlog scales the pool to drain it.
        self.async_demand = async_demand
        # Several API processes (a leader election): followers push the demand their
        # gateways counted, the leader adds it to its own before each autoscaler step.
        self.shared_demand = shared_demand
        self.async_queued: dict[tuple[int, str], float] = {}
        # The shared warm tier (local backend, EMBER_WARM_SET_BYTES): versions with no ready
        # replica held in host RAM, so a standby process loads them from the page cache.
        self.warm_tier = warm_tier
        if warm_tier is not None:
            warm_tier.register_metrics(self.metrics.registry)
        # What the dashboard plots (ember.pools.history): sampled by the acting controller.
        self.history = history

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ember-pools")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.leading:  # what it learned, for the next controller (or this one restarted)
            await self._save_states(force=True)
        self.autoscalers.close()
        if self.backend.replicas_outlive_controller:  # a successor adopts them
            if self.leader is not None and self.leading:
                await asyncio.to_thread(self.leader.release)
            await asyncio.to_thread(self.backend.close)
        else:
            for replica in list(self.replicas.values()):
                await asyncio.to_thread(self.backend.stop, replica.handle, 5.0)
        await self.replica_api.aclose()
        if self.shared_demand is not None:
            self.shared_demand.close()
        if self.warm_tier is not None:
            await self.warm_tier.close()

    async def _run(self) -> None:
        while True:
            try:
                if await self._lead():
                    await self.reconcile()
                else:
                    await self._follow()
            except Exception:  # a bad tick must not stop the controller
                log.exception("reconcile failed")
            await asyncio.sleep(self.tick_s)

    async def reconcile(self) -> None:
        await self._read_if_due()
        if self.shared_demand is not None:
            await self._gather_demand(self.shared_demand)
        self._reap_exited()
        await self._check_starting()
        await self._probe_idle()
        await self._restore_states()
        self._autoscale()
        await self._save_states()
        self._carry_out()
        self._keep_standby()
        self.publish()
        if self.warm_tier is not None:
            self.warm_tier.tick(self)
        self.metrics.observe(self.replicas.values(), leading=self.leading)
        if self.history is not None:
            await self.history.tick(self.deployments, self.replicas, self.scalers)

    def refresh(self) -> None:
        """Re-read the registry now (blocking: call it from a thread), e.g. right after an
        API call changed a deployment, so the next request routes by the change."""
        self._read_if_changed(time.monotonic(), force=True)

    async def _gather_demand(self, shared: SharedDemand) -> None:
        """The leader adds what the followers' gateways counted to its own count."""
        try:
            theirs = await asyncio.to_thread(shared.drain)
        except Exception:
            log.warning("could not read the followers' demand; sizing on this process's")
            return
        self.autoscalers.add(theirs)

    async def _read_if_due(self) -> None:
        now = time.monotonic()
        if self.registry.due(now):  # policy changes apply within its every_s (1 s)
            await asyncio.to_thread(self._read_if_changed, now)
            if self.async_demand is not None:
                self.async_queued = await asyncio.to_thread(self.async_demand)

    def _read_if_changed(self, now: float, *, force: bool = False) -> None:
        """The deployments, when the registry view changed (``RegistryView``); blocking."""
        views = self.registry.read_if_changed(now, force=force)
        if views is not None:
            self.deployments = views
            self.metrics.tenant_names = self.registry.tenant_names

    # --- leadership (only with a leader election) ---------------------------------------

    async def _lead(self) -> bool:
        """Whether this controller acts now: always without an election; else while it
        holds the Lease (renewed every third of its duration)."""
        if self.leader is None:
            return True
        if time.monotonic() - self._lease_checked >= self.leader.renew_every_s:
            self._lease_checked = time.monotonic()
            leading = await asyncio.to_thread(self.leader.step)
        else:
            leading = self.leader.is_leader
        if leading and not self.leading:
            await self._adopt()
        elif self.leading and not leading:
            self._abdicate()
        self.leading = leading
        return leading

    async def _adopt(self) -> None:
        """Elected: act for the replicas that exist (observed state), restarting none."""
        self._sync_observed(await asyncio.to_thread(self.backend.adopt), prune=True)
        self.autoscalers.restart()  # what followers counted is no one interval's demand
        log.info("pools controller elected: acting", adopted=len(self.replicas))

    def _abdicate(self) -> None:
        """Lost the Lease: stop acting at once (another controller may act already)."""
        for task in list(self._assigning):
            task.cancel()
        self.scalers.clear()  # the next leader goes on from the stored state; so will we
        log.warning("pools controller lost its lease: following")

    async def _follow(self) -> None:
        """Not elected: keep the routing table from the replicas the backend observes
        (routed once the pod is Ready and the replica says hot); change nothing."""
        await self._read_if_due()
        if self.shared_demand is not None and self.demand:
            counted = self.autoscalers.take_all()
            try:
                await asyncio.to_thread(self.shared_demand.push, counted)
            except Exception:  # Redis away: this tick's share is lost, not the controller
                log.warning("could not share the gateway's demand with the leader")
        observed = self.backend.observe()
        self._sync_observed(observed, prune=True)
        ready = {o.handle.replica_id for o in observed if o.ready}
        for replica in self.replicas.values():
            if replica.state is ReplicaState.ready and replica.handle.replica_id not in ready:
                replica.state, replica.route = ReplicaState.starting, None  # demoted, unready
        self.publish()
        await asyncio.gather(
            *(
                self._check_one(r)
                for r in self.replicas.values()
                if r.state is ReplicaState.starting and r.handle.replica_id in ready
            )
        )
        self.publish()
        self.metrics.observe(self.replicas.values(), leading=self.leading)

    def _sync_observed(self, observed: list[ObservedReplica], prune: bool) -> None:
        """Track replicas found in the backend (``starting`` until ``/info`` tells their
        state); with ``prune``, forget tracked ones that are no longer there."""
        seen = set()
        for o in observed:
            seen.add(o.handle.replica_id)
            if o.handle.replica_id not in self.replicas:
                key = DeploymentKey(o.tenant_id, o.deployment) if o.deployment else STANDBY_POOL
                tier = Tier.standby if key.standby_pool else Tier.hot
                replica = ManagedReplica(o.handle, key, o.model, o.version, tier=tier)
                replica.adopted = True
                self.replicas[o.handle.replica_id] = replica
        if prune:
            for replica_id in set(self.replicas) - seen:
                self.replicas.pop(replica_id)

    # --- replica states -----------------------------------------------------------------

    def _event(self, kind: str, replica: ManagedReplica, **fields: Any) -> None:
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
        self.events = [*self.events[-199:], event]
        with model_context(replica.model, replica.version, replica_id=replica.handle.replica_id):
            log.info(f"replica {kind}", **fields)

    def _fail(self, replica: ManagedReplica, reason: str) -> None:
        replica.state, replica.reason = ReplicaState.failed, reason
        if self.leading:  # a follower only forgets it; the acting controller replaces it
            self.backend.kill(replica.handle)  # nothing to drain, a hung one gets no grace
        self.replicas.pop(replica.handle.replica_id, None)
        if not replica.key.standby_pool:
            key = (replica.key, replica.version)
            self.failures[key] = self.failures.get(key, 0) + 1
        self.publish()
        self._event("failed", replica, reason=reason)

    def _reap_exited(self) -> None:
        for replica in list(self.replicas.values()):
            if (
                replica.state is ReplicaState.draining
            ):  # being stopped: its exit is the plan, no failure
                continue
            status = self.backend.exited(replica.handle)
            if status is not None:
                self.metrics.replaced.labels(*self.metrics.of_replica(replica), "exited").inc()
                reason = self.backend.exit_reason(replica.handle)
                self._fail(replica, reason or f"process exited with status {status}")

    async def _check_starting(self) -> None:
        starting = [r for r in self.replicas.values() if r.state is ReplicaState.starting]
        for replica in starting:
            self._note_queued(replica)
        await asyncio.gather(*(self._check_one(r) for r in starting if r.queued is None))

    def _note_queued(self, replica: ManagedReplica) -> None:
        """Whether the backend still holds the replica back (its state says why); its
        start time is when it leaves the queue, so a cold start's figure is its own."""
        waiting = self.backend.waiting(replica.handle)
        if waiting is not None and replica.queued is None:
            self._event("queued", replica, reason=waiting)
        elif waiting is None and replica.queued is not None:
            replica.started_at = time.monotonic()
            self._event("dequeued", replica, pid=replica.handle.pid, port=replica.handle.port)
        replica.queued = waiting

    async def _check_one(self, replica: ManagedReplica) -> None:
        info = await self.replica_api.info(replica.handle)
        if info is None:
            return  # not listening yet
        if info.get("state") == "failed":
            self._fail(replica, info.get("failure") or "load failed")
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
                idle_hold = self.autoscalers.knobs.get("idle_hold_s", WAKE_HOLD_S)
                self.woken[(replica.key, replica.version)] = replica.ready_at + idle_hold
            if not spare and replica.tier is Tier.hot and replica.then_tier is Tier.warm:
                replica.then_tier = None  # a warm spare: loaded, now demoted (not routed)
                self._change_tier(replica, Tier.warm)
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
            self._event("ready", replica, startup_s=round(replica.ready_at - replica.started_at, 3),
                        load=(info.get("load_report") or {}).get("stages"))  # fmt: skip

    async def _probe_idle(self) -> None:
        now = time.monotonic()
        idle = [
            r
            for r in self.replicas.values()
            if r.state in (ReplicaState.ready, ReplicaState.standby)
            and now - r.last_ok >= self.probe_settings.idle_s
        ]
        await asyncio.gather(*(self._probe_one(r) for r in idle))

    async def _probe_one(self, replica: ManagedReplica) -> None:
        if await self.replica_api.healthy(replica.handle):
            replica.probe_failures, replica.last_ok = 0, time.monotonic()
            return
        replica.probe_failures += 1
        if replica.probe_failures >= self.probe_settings.failures:
            detected = time.monotonic() - replica.last_ok
            labels = self.metrics.of_replica(replica)
            self.metrics.detect_seconds.labels(*labels).observe(detected)
            self.metrics.replaced.labels(*labels, "probe").inc()
            self._fail(replica, f"failed {replica.probe_failures} health probes")
            self._event("killed", replica, detected_after_s=round(detected, 3))

    def mark_ok(self, replica_id: str) -> None:
        """The gateway saw a real request succeed: no probe needed for a while."""
        replica = self.replicas.get(replica_id)
        if replica is not None:
            replica.last_ok = time.monotonic()

    # --- scaling ------------------------------------------------------------------------

    def desired(self, view: DeploymentView) -> dict[str, int]:
        """Hot replicas per version (:func:`~ember.pools.plan.hot_target`): the
        autoscaler's for production, a proportional share of the floor for a canary; one
        each for the ladder's fallback rung and versions pinned by running batch runs."""
        policy = view.policy
        key = view.key
        now = time.monotonic()
        out: dict[str, int] = {}
        for version, weight in view.traffic.items():
            if weight <= 0 or version not in view.specs:
                continue
            target = self.targets.get((key, version))
            out[version] = hot_target(
                target.hot if target is not None else None,
                floor=policy.hot_floor,
                weight=weight,
                production=version == view.production,
                woken=now < self.woken.get((key, version), -math.inf),
                max_replicas=policy.max_replicas,
            )
        for version in [*view.fallback, *view.pinned]:
            if version in view.specs and version not in out:
                out[version] = 1
        return out

    def inventory(self, key: DeploymentKey, version: str) -> Inventory:
        """The version's replicas by state, as :func:`~ember.pools.plan.plan` counts them."""
        return self.replicas.inventory(key, version)

    def plans(self, key: DeploymentKey) -> dict[str, tuple[Inventory, Target, Actions]]:
        """What to do for each version of a deployment (or of one deleted: stop it all)."""
        view = self.deployments.get(key)
        wanted = self.desired(view) if view is not None else {}
        versions = set(wanted) | {r.version for r in self.replicas.of(key)}
        inventories = {v: self.inventory(key, v) for v in versions}
        may_retire = all_ready(wanted, {v: inventories[v].hot for v in wanted})
        out: dict[str, tuple[Inventory, Target, Actions]] = {}
        for version in sorted(versions):
            if version in wanted:
                tiers = self.targets.get((key, version))
                production = view is not None and version == view.production
                warm = tiers.warm if tiers is not None and production else 0
                target = Target(wanted[version], warm)
            else:
                target = Target(0, serving=False)
            inv = inventories[version]
            actions = plan(
                inv,
                target,
                fill_warm=self.fill_warm,
                may_retire=may_retire,
                crash_looping=self.failures.get((key, version), 0) >= self.max_restarts,
            )
            out[version] = (inv, target, actions)
        return out

    def _carry_out(self) -> None:
        """Every deployment's plan, carried out: which replicas move is chosen here (the
        least loaded, then the newest, steps down first)."""
        keys = set(self.deployments) | self.replicas.deployments()
        for key in sorted(keys):
            for version, (_, _, actions) in self.plans(key).items():
                if actions:
                    self._act(key, version, actions)

    def _act(self, key: DeploymentKey, version: str, actions: Actions) -> None:
        mine = self.replicas.of(key, version)

        def least_busy(rs: list[ManagedReplica]) -> list[ManagedReplica]:
            return sorted(
                rs,
                key=lambda r: (self.table.inflight_units(r.handle.replica_id), -r.started_at),
            )

        hot = least_busy(self.replicas.ready(key, version, Tier.hot))
        warm = least_busy(self.replicas.ready(key, version, Tier.warm))
        loading = [r for r in mine if r.state is ReplicaState.starting and r.then_tier is Tier.warm]
        for replica in warm[: actions.promote]:
            self._change_tier(replica, Tier.hot)
        for replica in loading[: actions.keep_hot]:
            replica.then_tier = None
        view = self.deployments.get(key)
        if view is not None and version in view.specs:
            for _ in range(actions.start_hot):
                self._start(view, version)
            for _ in range(actions.start_warm):
                self._start(view, version, then_tier=Tier.warm)
        for replica in hot[: actions.demote]:
            self._change_tier(replica, Tier.warm)
        stops = hot[actions.demote : actions.demote + actions.stop_hot]
        stops += warm[actions.promote : actions.promote + actions.stop_warm]
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
        stops += on_the_way[: actions.stop_starting]
        starts = [r for r in mine if r.state is ReplicaState.starting and r.then_tier is None]
        stops += sorted(starts, key=lambda r: -r.started_at)[: actions.cancel_hot]
        for replica in stops:
            self._stop(replica)

    def _stop(self, replica: ManagedReplica) -> None:
        replica.state = ReplicaState.draining
        self.publish()
        self._event("draining", replica)
        self._spawn(self._drain(replica))

    # --- autoscaling --------------------------------------------------------------------

    def record_demand(
        self,
        key: tuple[int, str],
        version: str,
        units: float,
        admitted: bool,
        *,
        arrived: bool = True,
    ) -> None:
        """The gateway reports every arrival (admitted or shed) in model units, once:
        ``arrived=False`` for the admission of a request whose arrival it reported
        already (one that waited for a replica)."""
        key = DeploymentKey(*key)
        self.autoscalers.count((key, version), units, arrived=arrived, admitted=admitted)
        if arrived and self.warm_tier is not None:
            self.warm_tier.demanded(key, version)

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
            self.events = [*self.events[-199:], event]
            log.info("standby pool grown", size=grown.size, peak_asks=grown.peak_asks)

    def _autoscale(self) -> None:
        dt = self.autoscalers.due(time.monotonic())
        if dt is None:
            return
        for key, view in self.deployments.items():
            version = view.production
            if version is not None:
                scaler = self.scaler(key, view, version)
                observed = self.observation(key, view, version, dt)
                self.targets[(key, version)] = scaler.step(observed).desired

    def scaler(
        self, key: DeploymentKey, view: DeploymentView, version: str
    ) -> Autoscaler[EmberState, EmberConfig]:
        """The version's autoscaler (:meth:`~ember.pools.scaling.Autoscalers.scaler`)."""
        return self.autoscalers.scaler(key, view, version)

    async def _restore_states(self) -> None:
        await self.autoscalers.restore(self.deployments)

    async def _save_states(self, *, force: bool = False) -> None:
        await self.autoscalers.save(self.deployments, force=force)

    # The autoscalers' state, as the controller has always shown it (the API, the tests).

    @property
    def scalers(self) -> dict[DemandKey, Autoscaler[EmberState, EmberConfig]]:
        return self.autoscalers.scalers

    @property
    def targets(self) -> dict[DemandKey, TierCounts]:
        return self.autoscalers.targets

    @property
    def demand(self) -> dict[DemandKey, list[float]]:
        return self.autoscalers.demand

    @property
    def promotion(self) -> PromotionLearner:
        return self.autoscalers.promotion

    @property
    def forecast_store(self) -> ForecastStore | None:
        return self.autoscalers.store

    @forecast_store.setter
    def forecast_store(self, store: ForecastStore | None) -> None:
        self.autoscalers.store = store

    def observation(
        self, key: DeploymentKey, view: DeploymentView, version: str, dt: float
    ) -> Observation:
        """What the version saw over the last ``dt`` seconds (takes the gateway's count)."""
        mine = self.replicas.of(key, version)
        hot = [r for r in mine if r.ready_in is Tier.hot]
        arrived, admitted = self.autoscalers.take((key, version))
        inflight = sum(self.table.inflight_units(r.handle.replica_id) for r in hot)
        unit = view.cost(version).cost(1)
        return Observation(
            interval_s=dt,
            arrived_units_per_s=arrived / dt,
            admitted_units_per_s=admitted / dt,
            inflight_units=inflight,
            queued_units=max(0.0, inflight - len(hot) * view.policy.max_batch_size * unit),
            async_queued_units=self.async_queued.get(key, 0.0),
            capacity_units_per_s=view.capacity_units_per_s(version),
            ready=TierCounts(
                hot=len(hot),
                warm=sum(1 for r in mine if r.ready_in is Tier.warm),
                standby=len(self.replicas.standby_ready()),
            ),
            promoting=sum(1 for r in mine if r.coming_hot),
            promotion=self.promotion.times(),
        )

    def _change_tier(self, replica: ManagedReplica, tier: Tier) -> None:
        replica.state = ReplicaState.promoting if tier is Tier.hot else ReplicaState.demoting
        self.publish()
        self._spawn(self._set_tier(replica, tier))

    async def _set_tier(self, replica: ManagedReplica, tier: Tier) -> None:
        started = time.monotonic()
        if not await self.replica_api.set_tier(replica.handle, tier):
            self._fail(replica, f"tier change to {tier} failed")
            return
        replica.state, replica.tier, replica.last_ok = ReplicaState.ready, tier, time.monotonic()
        self.publish()
        if tier is Tier.hot:
            self.promotion.record(Source.warm, time.monotonic() - started)
        self._event("tier", replica, tier=tier, seconds=round(time.monotonic() - started, 3))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._assigning.add(task)
        task.add_done_callback(self._assigning.discard)

    def _start(self, view: DeploymentView, version: str, *, then_tier: Tier | None = None) -> None:
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
            task = asyncio.get_running_loop().create_task(self._assign(replica, spec, options))
            self._assigning.add(task)
            task.add_done_callback(self._assigning.discard)
            self._event(
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
        self._event("starting", replica, pid=handle.pid, port=handle.port, then_tier=then_tier)

    async def _assign(
        self, replica: ManagedReplica, spec: VersionSpec, options: LaunchOptions
    ) -> None:
        """Give the standby process its version and the deployment's batch policy and
        threads (it was started with the defaults, before anyone knew its deployment)."""
        params = options.replica_settings()
        params |= self.backend.assign_query(replica.handle, spec, options)
        await self.replica_api.assign(replica.handle, spec, params)

    def standby_wanted(self) -> int:
        """The shared standby pool's size: what its asks sized it to, or the standby
        replicas the production versions' autoscalers want together, within its bounds."""
        return self.standby.wanted(self.autoscalers.standby(self.deployments))

    def _keep_standby(self) -> None:
        missing = self.standby_wanted() - len(self.replicas.spares())
        if missing <= 0:
            return
        options = LaunchOptions(reserve_bytes=self._standby_reserve())
        for _ in range(missing):
            handle = self.backend.launch(None, options)
            replica = ManagedReplica(handle, STANDBY_POOL, "", "", tier=Tier.standby)
            self.replicas[handle.replica_id] = replica
            self._event("starting", replica, standby=True, pid=handle.pid)

    def _standby_reserve(self) -> int:
        """The memory a new standby process faults in for the weights it may be given: the
        largest version served that a standby process can become and that fits in
        ``standby_reserve_max``, rounded up to whole huge pages; 0 for none."""
        sizes = [
            whole_huge_pages(size)
            for view in self.deployments.values()
            for version, size in view.sizes.items()
            if version in view.specs and self.backend.standby_can_run(view.specs[version])
        ]
        return max((n for n in sizes if n <= self.standby_reserve_max), default=0)

    async def _drain(self, replica: ManagedReplica, wait_s: float = 30.0) -> None:
        deadline = time.monotonic() + wait_s
        rid = replica.handle.replica_id
        while self.table.inflight_units(rid) > 0 and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a counter the serving side owns
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.backend.stop, replica.handle)
        self.replicas.pop(rid, None)
        self.publish()
        self._event("stopped", replica)

    # --- routing table ------------------------------------------------------------------

    def publish(self) -> None:
        """Publish the routing table (:class:`~ember.serving.routing.RoutingTable`) from the
        replicas (:meth:`~ember.pools.inventory.ReplicaInventory.lanes`). Called after every
        change of what is routable, so a request never scans the replicas."""
        self.table.publish(self.replicas.lanes(), tracked=self.replicas.routes())

    def wake(self, key: tuple[int, str], version: str) -> bool:
        """A request wants ``version`` and it has no routable replica: whether a hot one is
        on its way (published in the routing table) or could be — a ``scale_to_zero``
        deployment holding nothing is woken here: a replica of the version starts at the
        next tick."""
        key = DeploymentKey(*key)
        if self.table.lane(key, version).coming:
            return True
        view = self.deployments.get(key)
        if (
            view is None
            or not view.policy.scale_to_zero
            or version not in view.specs
            or self.failures.get((key, version), 0) >= self.max_restarts
        ):
            return False
        now = time.monotonic()
        if self.woken.get((key, version), -math.inf) < now:
            log.info("waking a scaled-to-zero deployment", deployment=key.name, version=version)
            self.woken[(key, version)] = now + WAKE_HOLD_S
        return True

    def routable_traffic(self, view: DeploymentView) -> dict[str, int]:
        """The deployment's weights over versions that have a ready replica; while a new
        version loads, the versions still running keep serving."""
        key = view.key
        ready = {v: w for v, w in view.traffic.items() if w > 0 and self.table.routes(key, v)}
        if ready:
            return ready
        running = self.replicas.hot_versions(key) - (
            (set(view.fallback) | set(view.pinned)) - set(view.traffic)
        )
        # (fallbacks answer only as the ladder; pinned versions only their runs)
        if running:
            return {v: 1 for v in sorted(running)}
        raise NotReady(f"deployment {view.name!r} has no ready replica yet", deployment=view.name)

    def replicas_of(self, key: tuple[int, str]) -> list[dict[str, Any]]:
        return [
            r.public(self.table.inflight_units(r.handle.replica_id)) for r in self.replicas.of(key)
        ]

    def autoscaler_of(self, key: tuple[int, str]) -> dict[str, Any]:
        """The production version's autoscaler, shown
        (:meth:`~ember.pools.scaling.Autoscalers.describe`); ``acting`` is false on a
        controller that follows another."""
        key = DeploymentKey(*key)
        view = self.deployments.get(key)
        return self.autoscalers.describe(key, view, acting=self.leading)
