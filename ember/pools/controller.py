"""The pools controller: a reconcile loop that keeps each deployment's replicas as they
should be, and the routing table the gateway reads.

Every tick it reads the deployments from the registry, reaps replicas whose process
exited, promotes ``starting`` replicas that answer ``/info`` ready, probes idle ready
replicas through ``/healthz`` (killing and replacing those that stop answering), starts
what is missing (taking a standby process when one is ready), retires versions that no
longer get traffic once the new ones are ready, and keeps a small standby pool.
All process calls go through the ``ReplicaBackend``.

With a leader election (several API replicas on a cluster), only the elected controller
acts; the others follow — they keep the routing table from the replicas the backend
observes and change nothing. A newly elected controller adopts the replicas that exist
instead of starting its own.

This module is the loop that decides — leadership, the tick, each version's plan — and
what the serving side calls (``ControlPlane``: the routing table, the deployments, demand,
wake-ups) and reads; the rest is each its own piece: what is done to the replicas
(``actions``: starts, tier changes, drains, failures, probes, the standby pool), the
replicas and their typed state (``inventory``), the deployments read from the registry
(``registry_view``), the replicas' control endpoints (``replica_control``, used by the
actions), the autoscalers and their saved state (``scaling``) and what it learns
(``learners``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ember.domain.spec import DeploymentKey, ReplicaState, Tier
from ember.errors import NotReady
from ember.logs import get_logger
from ember.pools.actions import ProbeSettings, ReplicaActions
from ember.pools.autoscaler import Autoscaler, EmberConfig, EmberState, Observation, TierCounts
from ember.pools.backends.base import ReplicaBackend
from ember.pools.demand import DemandKey, ForecastStore, SharedDemand
from ember.pools.inventory import ReplicaInventory
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
from ember.pools.scaling import Autoscalers
from ember.pools.warmtier import SharedWarmTier
from ember.serving.routing import DeploymentView, RoutingTable

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from ember.pools.history import History
    from ember.pools.leader import LeaseElection

log = get_logger(__name__)

WAKE_HOLD_S = 60.0
"""A woken scale-to-zero version is wanted hot this long while its replica starts."""


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
        self.backend = backend
        self.leader = leader
        self.leading = leader is None
        self._lease_checked = -math.inf
        self.standby = StandbySizer(standby_pool, standby_max)
        """The shared standby pool's size: the floor, grown by the starts that ask for one."""
        self.tick_s = tick_s
        self.max_restarts = max_restarts
        self.replicas = ReplicaInventory()
        self.deployments: dict[DeploymentKey, DeploymentView] = {}
        self.table = RoutingTable()
        """What the serving side routes by (``publish``); it counts in-flight units there."""
        self.metrics = PoolMetrics()
        backend.register_metrics(self.metrics.registry)
        self._task: asyncio.Task[None] | None = None
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
        self.actions = ReplicaActions(
            backend,
            self.replicas,
            self.table,
            self.metrics,
            standby=self.standby,
            promotion=self.promotion,
            probe=probe or ProbeSettings(),
            woken=self.woken,
            idle_hold_s=self.autoscalers.knobs.get("idle_hold_s", WAKE_HOLD_S),
            leading=lambda: self.leading,
            warm_tier=warm_tier,
            standby_reserve_max=standby_reserve_max,
        )
        """What is done to the replicas (started, tiered, drained, failed, probed)."""

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
        await self.actions.replica_api.aclose()
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
        self.actions.reap_exited()
        await self.actions.check_starting()
        await self.actions.probe_idle()
        await self._restore_states()
        self._autoscale()
        await self._save_states()
        self._carry_out()
        self._keep_standby()
        self.publish()
        if self.warm_tier is not None:
            self.warm_tier.tick(self.deployments, self.replicas)
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
        self.replicas.track(await asyncio.to_thread(self.backend.adopt), prune=True)
        self.autoscalers.restart()  # what followers counted is no one interval's demand
        log.info("pools controller elected: acting", adopted=len(self.replicas))

    def _abdicate(self) -> None:
        """Lost the Lease: stop acting at once (another controller may act already)."""
        self.actions.cancel()
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
        self.replicas.track(observed, prune=True)
        ready = {o.handle.replica_id for o in observed if o.ready}
        for replica in self.replicas.values():
            if replica.state is ReplicaState.ready and replica.handle.replica_id not in ready:
                replica.state, replica.route = ReplicaState.starting, None  # demoted, unready
        self.publish()
        await asyncio.gather(
            *(
                self.actions.check_one(r)
                for r in self.replicas.values()
                if r.state is ReplicaState.starting and r.handle.replica_id in ready
            )
        )
        self.publish()
        self.metrics.observe(self.replicas.values(), leading=self.leading)

    # --- the gateway's word -------------------------------------------------------------

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
            todo = plan(
                inv,
                target,
                fill_warm=self.fill_warm,
                may_retire=may_retire,
                crash_looping=self.actions.failures.get((key, version), 0) >= self.max_restarts,
            )
            out[version] = (inv, target, todo)
        return out

    def _carry_out(self) -> None:
        """Every deployment's plan, carried out (:meth:`~ember.pools.actions.ReplicaActions.act`
        picks which replicas move)."""
        keys = set(self.deployments) | self.replicas.deployments()
        for key in sorted(keys):
            for version, (_, _, todo) in self.plans(key).items():
                if todo:
                    self.actions.act(self.deployments.get(key), key, version, todo)

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

    def standby_wanted(self) -> int:
        """The shared standby pool's size: what its asks sized it to, or the standby
        replicas the production versions' autoscalers want together, within its bounds."""
        return self.standby.wanted(self.autoscalers.standby(self.deployments))

    def _keep_standby(self) -> None:
        """The standby pool topped up to its wanted size (``standby_wanted``)."""
        self.actions.keep_standby(self.standby_wanted(), self.deployments.values())

    # --- routing table ------------------------------------------------------------------

    def publish(self) -> None:
        """Publish the routing table (:class:`~ember.serving.routing.RoutingTable`) from the
        replicas (:meth:`~ember.pools.inventory.ReplicaInventory.lanes`). Called after every
        change of what is routable, so a request never scans the replicas
        (:meth:`~ember.pools.actions.ReplicaActions.publish`, which every action calls)."""
        self.actions.publish()

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
            or self.actions.failures.get((key, version), 0) >= self.max_restarts
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

    @property
    def events(self) -> list[dict[str, Any]]:
        """The latest replica events (:meth:`~ember.pools.actions.ReplicaActions.event`)."""
        return self.actions.events

    def autoscaler_of(self, key: tuple[int, str]) -> dict[str, Any]:
        """The production version's autoscaler, shown
        (:meth:`~ember.pools.scaling.Autoscalers.describe`); ``acting`` is false on a
        controller that follows another."""
        key = DeploymentKey(*key)
        view = self.deployments.get(key)
        return self.autoscalers.describe(key, view, acting=self.leading)
