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
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, func
from sqlalchemy import select as sa_select
from sqlmodel import col, select

from ember.costmodel import hardware_key
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
from ember.pools.autoscaler import (
    Autoscaler,
    EmberConfig,
    EmberState,
    Observation,
    TierCounts,
    ember_autoscaler,
    state_from_dict,
    state_to_dict,
)
from ember.pools.backends.base import (
    LaunchOptions,
    ObservedReplica,
    ReplicaBackend,
    ReplicaHandle,
)
from ember.pools.demand import ForecastStore, SharedDemand
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
from ember.pools.replica_control import ReplicaControl
from ember.pools.warmtier import SharedWarmTier
from ember.registry import catalog
from ember.registry.db import session_scope
from ember.registry.schemas import PoolPolicy
from ember.registry.tables import (
    BatchRun,
    Deployment,
    Model,
    ModelVersion,
    Tenant,
    VersionStatus,
)
from ember.serving.router import Route
from ember.serving.routing import DeploymentView, Lane, RoutingTable

if TYPE_CHECKING:
    from ember.config import Settings
    from ember.pools.history import History
    from ember.pools.leader import LeaseElection

log = get_logger(__name__)

REGISTRY_FULL_S = 10.0
"""The registry view is re-read whole at least this often, changed or not."""

WAKE_HOLD_S = 60.0
"""A woken scale-to-zero version is wanted hot this long while its replica starts."""


@dataclass(frozen=True)
class ProbeSettings:
    idle_s: float = 5.0
    """Probe a ready replica that completed no request for this long."""
    timeout_s: float = 2.0
    failures: int = 2
    """Consecutive failed probes before the replica is killed and replaced."""


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
        self.db = db
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
        self.replicas: dict[str, ManagedReplica] = {}
        self.deployments: dict[DeploymentKey, DeploymentView] = {}
        self.failures: dict[tuple[DeploymentKey, str], int] = {}
        self.events: list[dict[str, Any]] = []
        self.table = RoutingTable()
        """What the serving side routes by (``publish``); it counts in-flight units there."""
        self.metrics = PoolMetrics()
        backend.register_metrics(self.metrics.registry)
        self.hardware = hardware_key("cpu")
        self.replica_api = ReplicaControl.with_timeout(self.probe_settings.timeout_s)
        """The replicas' control endpoints (``/info``, ``/healthz``, ``/tier``, ``/assign``)."""
        self._task: asyncio.Task[None] | None = None
        self._assigning: set[asyncio.Task[None]] = set()
        # The predictive autoscaler (the same code the simulator replays) per production
        # version, fed with what the gateway saw since the last step.
        self.scalers: dict[tuple[DeploymentKey, str], Autoscaler[EmberState, EmberConfig]] = {}
        self.targets: dict[tuple[DeploymentKey, str], TierCounts] = {}
        self.demand: dict[tuple[DeploymentKey, str], list[float]] = {}
        # Seconds to serving, per tier promoted from: the autoscaler's lead is their p95
        # (PromotionTimes' measured defaults until a tier has samples).
        self.promotion = PromotionLearner()
        self._promotion_restored = False
        self.fill_warm = fill_warm
        """Start replicas into the warm tier when the autoscaler wants more warm ones than
        demoting hot ones gives. Off by default: on the local (CPU) backend a warm replica
        holds as much memory as a hot one."""
        self.autoscale_every_s = 1.0
        self.autoscale_knobs = dict(autoscale or {})
        """EmberConfig knobs for every deployment (``idle_hold_s``, ``warm_keep_s``)."""
        # Scale-to-zero deployments woken by a request while they held no replica: the
        # version is wanted hot (at least one) until this monotonic time — a start's worth,
        # then, once ready, the idle hold — after which the autoscaler, having seen the
        # demand, decides.
        self.woken: dict[tuple[DeploymentKey, str], float] = {}
        self.registry_every_s = 1.0
        self._last_read = self._last_full_read = -math.inf
        self._fingerprint: tuple[Any, ...] | None = None
        self._last_step = time.monotonic()
        # The job queue's hook (ember.jobs.demand): (tenant id, deployment) -> model units
        # of unfinished async jobs, read in a thread with the registry; added to the
        # production version's queued units, so a backlog scales the pool to drain it.
        self.async_demand = async_demand
        # Several API processes (a leader election): followers push the demand their
        # gateways counted, the leader adds it to its own before each autoscaler step.
        self.shared_demand = shared_demand
        self.async_queued: dict[tuple[int, str], float] = {}
        # The autoscalers' state (a learned daily profile) in Redis: saved every
        # ``state_every_s``, restored by whichever controller acts next (restart, new leader).
        self.forecast_store = forecast_store
        self.state_every_s = 10.0
        self._state_saved = time.monotonic()
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
        if self.forecast_store is not None:
            self.forecast_store.close()
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
        self.metrics.observe(self)
        if self.history is not None:
            await self.history.tick(self)

    def refresh(self) -> None:
        """Re-read the registry now (blocking: call it from a thread), e.g. right after an
        API call changed a deployment, so the next request routes by the change."""
        self._last_read = time.monotonic()
        self._read_if_changed(self._last_read, force=True)

    async def _gather_demand(self, shared: SharedDemand) -> None:
        """The leader adds what the followers' gateways counted to its own count."""
        try:
            theirs = await asyncio.to_thread(shared.drain)
        except Exception:
            log.warning("could not read the followers' demand; sizing on this process's")
            return
        for key, (arrived, admitted) in theirs.items():
            mine = self.demand.setdefault(key, [0.0, 0.0])
            mine[0] += arrived
            mine[1] += admitted

    async def _read_if_due(self) -> None:
        now = time.monotonic()
        if now - self._last_read >= self.registry_every_s:  # policy changes apply within 1 s
            self._last_read = now
            await asyncio.to_thread(self._read_if_changed, now)
            if self.async_demand is not None:
                self.async_queued = await asyncio.to_thread(self.async_demand)

    def _read_if_changed(self, now: float, *, force: bool = False) -> None:
        """Every second a cheap fingerprint of what routing depends on (deployments, running
        batch runs, ready versions); the whole view only when it changed, and every
        ``registry_full_every_s`` regardless (calibrated cost models carry no timestamp).
        A full read every second cost 12-17 ms of CPU per second on an idle API."""
        fingerprint = self._registry_fingerprint()
        due = now - self._last_full_read >= REGISTRY_FULL_S
        if force or due or fingerprint != self._fingerprint:
            self._fingerprint = fingerprint
            self.deployments = self._read_registry()
            self._last_full_read = now

    def _registry_fingerprint(self) -> tuple[Any, ...]:
        with self.db.connect() as conn:
            deployments = conn.execute(
                sa_select(
                    func.count(), func.max(Deployment.updated_at), func.sum(Deployment.id)
                ).select_from(Deployment)
            ).one()
            versions = conn.execute(
                sa_select(func.count(), func.max(ModelVersion.validated_at)).where(
                    col(ModelVersion.status) == VersionStatus.ready
                )
            ).one()
            runs = conn.execute(
                sa_select(col(BatchRun.tenant_id), col(BatchRun.deployment), col(BatchRun.version))
                .where(col(BatchRun.status) == "running")
                .order_by(col(BatchRun.id))
            ).all()
        return tuple(deployments), tuple(versions), tuple(tuple(r) for r in runs)

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
        self.demand.clear()  # what followers counted is no one interval's demand
        self._last_step = time.monotonic()
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
            counted, self.demand = self.demand, {}
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
        self.metrics.observe(self)

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

    # --- registry -----------------------------------------------------------------------

    def _read_registry(self) -> dict[DeploymentKey, DeploymentView]:
        views: dict[DeploymentKey, DeploymentView] = {}
        with session_scope(self.db) as session:
            pins: dict[DeploymentKey, set[str]] = {}
            for run in session.exec(select(BatchRun).where(BatchRun.status == "running")):
                run_key = DeploymentKey(run.tenant_id, run.deployment)
                pins.setdefault(run_key, set()).add(run.version)
            tenants = {t.id: t for t in session.exec(select(Tenant)) if t.id is not None}
            self.metrics.tenant_names = {i: t.name for i, t in tenants.items()}
            for d in session.exec(select(Deployment)):
                model = session.get(Model, d.model_id)
                if model is None:
                    continue
                pinned = pins.get(DeploymentKey(d.tenant_id, d.name), set())
                wanted = {v for v, w in d.traffic.items() if w > 0} | set(d.fallback) | pinned
                rows = [
                    r
                    for r in session.exec(
                        select(ModelVersion).where(
                            ModelVersion.model_id == model.id,
                            col(ModelVersion.version).in_(wanted),
                        )
                    )
                    if r.status is VersionStatus.ready
                ]
                tenant = tenants.get(d.tenant_id)  # trusted: replicas skip code checks
                trusted = {"trusted": bool(tenant is not None and tenant.trusted)}
                specs = {
                    r.version: VersionSpec.model_validate(
                        catalog.version_spec(model, r, self.hardware) | trusted
                    )
                    for r in rows
                }
                views[DeploymentKey(d.tenant_id, d.name)] = DeploymentView(
                    d.tenant_id,
                    d.name,
                    model.name,
                    dict(d.traffic),
                    PoolPolicy.model_validate(d.policy),
                    specs,
                    list(d.fallback),
                    sorted(pinned),
                    {r.version: r.size_bytes for r in rows if r.size_bytes},
                )
        return views

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
                idle_hold = self.autoscale_knobs.get("idle_hold_s", WAKE_HOLD_S)
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
        mine = [r for r in self.replicas.values() if r.key == key and r.version == version]
        return Inventory(
            hot=sum(1 for r in mine if r.state is ReplicaState.ready and r.tier is Tier.hot),
            warm=sum(1 for r in mine if r.state is ReplicaState.ready and r.tier is Tier.warm),
            starting_hot=sum(
                1
                for r in mine
                if r.state is ReplicaState.promoting
                or (r.state is ReplicaState.starting and r.then_tier is None)
            ),
            promoting=sum(1 for r in mine if r.state is ReplicaState.promoting),
            starting_warm=sum(
                1 for r in mine if r.state is ReplicaState.starting and r.then_tier is Tier.warm
            ),
            demoting=sum(1 for r in mine if r.state is ReplicaState.demoting),
        )

    def plans(self, key: DeploymentKey) -> dict[str, tuple[Inventory, Target, Actions]]:
        """What to do for each version of a deployment (or of one deleted: stop it all)."""
        view = self.deployments.get(key)
        wanted = self.desired(view) if view is not None else {}
        versions = set(wanted) | {r.version for r in self.replicas.values() if r.key == key}
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
        keys = set(self.deployments) | {
            r.key for r in self.replicas.values() if not r.key.standby_pool
        }
        for key in sorted(keys):
            for version, (_, _, actions) in self.plans(key).items():
                if actions:
                    self._act(key, version, actions)

    def _act(self, key: DeploymentKey, version: str, actions: Actions) -> None:
        mine = [r for r in self.replicas.values() if r.key == key and r.version == version]

        def least_busy(rs: list[ManagedReplica]) -> list[ManagedReplica]:
            return sorted(
                rs,
                key=lambda r: (self.table.inflight_units(r.handle.replica_id), -r.started_at),
            )

        hot = least_busy([r for r in mine if r.state is ReplicaState.ready and r.tier is Tier.hot])
        warm = least_busy(
            [r for r in mine if r.state is ReplicaState.ready and r.tier is Tier.warm]
        )
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
        arrived_admitted = self.demand.setdefault((key, version), [0.0, 0.0])
        if arrived:
            arrived_admitted[0] += units
            if self.warm_tier is not None:
                self.warm_tier.demanded(key, version)
        if admitted:
            arrived_admitted[1] += units

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
        now = time.monotonic()
        dt = now - self._last_step
        if dt < self.autoscale_every_s:
            return
        self._last_step = now
        for key, view in self.deployments.items():
            version = view.production
            if version is not None:
                self.targets[(key, version)] = self._step(key, view, version, dt)

    def _step(
        self, key: DeploymentKey, view: DeploymentView, version: str, dt: float
    ) -> TierCounts:
        return (
            self.scaler(key, view, version).step(self.observation(key, view, version, dt)).desired
        )

    def scaler(
        self, key: DeploymentKey, view: DeploymentView, version: str
    ) -> Autoscaler[EmberState, EmberConfig]:
        """The version's autoscaler: ``decide`` with the deployment's pool policy. A changed
        policy (new schedules, say) applies from the next step; what it learned stays."""
        scaler = self.scalers.get((key, version))
        config = self.autoscale_config(view)
        if scaler is not None and scaler.config != config:
            scaler.config = config
        if scaler is None:
            scaler = ember_autoscaler(
                config,
                clock=time.time,  # wall clock: the profiles are times of day, and persist
                model=view.model,
                version=version,
                keep_last=20,
            )
            self.scalers[(key, version)] = scaler
        return scaler

    def autoscale_config(self, view: DeploymentView) -> EmberConfig:
        return EmberConfig.from_policy(
            view.policy, tick_s=self.autoscale_every_s, **self.autoscale_knobs
        )

    async def _restore_states(self) -> None:
        """A production version without an autoscaler yet gets one, its state restored from
        the store when there is one (read in a thread; Redis away: start afresh)."""
        store = self.forecast_store
        if store is None:
            return
        if not self._promotion_restored:
            self._promotion_restored = True
            try:
                stored = await asyncio.to_thread(store.load_promotion)
            except Exception:  # Redis away: the defaults until measured here
                stored = {}
            self.promotion.restore(stored)  # what was learned before, then what is now
        for key, view in self.deployments.items():
            version = view.production
            if version is None or (key, version) in self.scalers:
                continue
            try:
                data = await asyncio.to_thread(store.load, (key, version))
            except Exception:  # Redis away: learn again rather than stop
                log.warning("could not read the autoscaler state", deployment=view.name)
                data = None
            scaler = self.scaler(key, view, version)
            state = None if data is None else state_from_dict(data, scaler.config)
            if state is not None:
                scaler.state = state
                with model_context(view.model, version):
                    log.info("autoscaler state restored", deployment=view.name,
                             level_units_per_s=round(state.forecaster.level, 4))  # fmt: skip

    async def _save_states(self, *, force: bool = False) -> None:
        store = self.forecast_store
        if store is None or not (self.scalers or self.deployments):
            return
        if not force and time.monotonic() - self._state_saved < self.state_every_s:
            return
        self._state_saved = time.monotonic()
        # A version the registry no longer has (its deployment deleted, or it removed from
        # the deployment) takes what it learned with it: a deployment created again under
        # the same name starts afresh.
        live = {(key, v) for key, view in self.deployments.items() for v in view.specs}
        for gone in [k for k in self.scalers if k not in live]:
            del self.scalers[gone]
            self.targets.pop(gone, None)
        states = {k: state_to_dict(s.state) for k, s in self.scalers.items()}

        promotion = {tier: list(xs) for tier, xs in self.promotion.samples.items()}

        def save() -> int:
            store.save(states, promotion)
            return store.keep_only(live)

        try:
            removed = await asyncio.to_thread(save)
        except Exception:  # Redis away: saved at the next try
            log.warning("could not save the autoscaler state")
            return
        if removed:
            log.info("autoscaler state of removed versions forgotten", versions=removed)

    def observation(
        self, key: DeploymentKey, view: DeploymentView, version: str, dt: float
    ) -> Observation:
        """What the version saw over the last ``dt`` seconds (takes the gateway's count)."""
        mine = [r for r in self.replicas.values() if r.key == key and r.version == version]
        hot = [r for r in mine if r.state is ReplicaState.ready and r.tier is Tier.hot]
        arrived, admitted = self.demand.pop((key, version), [0.0, 0.0])
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
                warm=sum(1 for r in mine if r.state is ReplicaState.ready and r.tier is Tier.warm),
                standby=sum(1 for r in self.replicas.values() if r.state is ReplicaState.standby),
            ),
            promoting=sum(
                1
                for r in mine
                if r.state is ReplicaState.promoting
                or (r.state is ReplicaState.starting and r.then_tier is None)
            ),
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
                for r in self.replicas.values()
                if r.state is ReplicaState.standby
                and self.backend.standby_can_take(r.handle, spec, options)
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
        wanted = sum(
            t.standby
            for (key, version), t in self.targets.items()
            if key in self.deployments and version == self.deployments[key].production
        )
        return self.standby.wanted(wanted)

    def _keep_standby(self) -> None:
        spares = [r for r in self.replicas.values() if r.key.standby_pool]
        missing = self.standby_wanted() - len(spares)
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
        """Publish the routing table (:class:`~ember.serving.routing.RoutingTable`): per
        (deployment, version) the routes of its ready hot replicas, and whether a hot one is
        on its way (starting, assigned, being promoted, or a warm one the autoscaler
        promotes on demand). Called after every change of what is routable; one pass over
        the replicas here, so a request never scans them."""
        routes: dict[tuple[DeploymentKey, str], list[Route]] = {}
        coming: set[tuple[DeploymentKey, str]] = set()
        for r in self.replicas.values():
            if r.key.standby_pool:
                continue
            lane = (r.key, r.version)
            if r.state is ReplicaState.ready and r.tier is Tier.hot and r.route is not None:
                routes.setdefault(lane, []).append(r.route)
            elif r.state in (ReplicaState.starting, ReplicaState.promoting) or (
                r.state is ReplicaState.ready and r.tier is Tier.warm
            ):
                coming.add(lane)
        self.table.publish(
            {k: Lane(tuple(routes.get(k, ())), k in coming) for k in routes.keys() | coming},
            tracked=(r.route for r in self.replicas.values() if r.route is not None),
        )

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
        running = {
            r.version
            for r in self.replicas.values()
            if r.key == key and r.state is ReplicaState.ready and r.tier is Tier.hot
        } - ((set(view.fallback) | set(view.pinned)) - set(view.traffic))
        # (fallbacks answer only as the ladder; pinned versions only their runs)
        if running:
            return {v: 1 for v in sorted(running)}
        raise NotReady(f"deployment {view.name!r} has no ready replica yet", deployment=view.name)

    def replicas_of(self, key: tuple[int, str]) -> list[dict[str, Any]]:
        return [
            r.public(self.table.inflight_units(r.handle.replica_id))
            for r in self.replicas.values()
            if r.key == key
        ]

    def autoscaler_of(self, key: tuple[int, str]) -> dict[str, Any]:
        """What the autoscaler of the deployment's production version forecast, wants per
        tier and why, the promotion times it plans with and its last decisions (for
        ``GET /v1/deployments/{name}/autoscaler``). ``acting`` is false on a controller
        that follows another (which decides; its view is the leader's to show)."""
        key = DeploymentKey(*key)
        view = self.deployments.get(key)
        version = view.production if view is not None else None
        scaler = self.scalers.get((key, version)) if version is not None else None
        promotion = self.promotion.times()
        out: dict[str, Any] = {
            "version": version,
            "acting": self.leading,
            "promotion_s": {"warm": promotion.warm_s, "standby": promotion.standby_s,
                            "cold": promotion.cold_s},
            "promotion_samples": {t: len(v) for t, v in self.promotion.samples.items()},
            "config": None, "forecast": [], "desired": None, "reasons": [], "decisions": [],
        }  # fmt: skip
        if scaler is None:
            return out
        cfg = scaler.config
        out["config"] = {
            "target_utilization": cfg.target_utilization, "forecast_quantile":
            cfg.forecast_quantile, "warm_cost": cfg.warm_cost, "standby_cost": cfg.standby_cost,
            "min_hot": cfg.min_hot, "max_replicas": cfg.max_replicas,
            "profile_periods_s": list(cfg.profile_periods_s),
            "level_units_per_s": _finite(scaler.state.forecaster.level),
        }  # fmt: skip
        if scaler.last:
            _, _, last = scaler.last[-1]
            out["forecast"] = [
                {"tier": s.tier.value, "from": s.source.value, "promotion_s": s.promotion_s,
                 "horizon_s": _finite(s.horizon_s),
                 "units_per_s": _finite(s.forecast_units_per_s), "replicas": s.replicas}
                for s in last.stages
            ]  # fmt: skip
            d = last.desired
            out["desired"] = {"hot": d.hot, "warm": d.warm, "standby": d.standby}
            out["reasons"] = list(last.reasons)
        out["decisions"] = [
            {"at": _finite(t), "hot": d.desired.hot, "warm": d.desired.warm,
             "standby": d.desired.standby, "arrived_units_per_s": _finite(o.arrived_units_per_s),
             "ready": {"hot": o.ready.hot, "warm": o.ready.warm, "standby": o.ready.standby}}
            for t, o, d in scaler.last
        ]  # fmt: skip
        return out


def autoscale_knobs(settings: Settings) -> dict[str, Any]:
    """The ``EmberConfig`` knobs the settings set for every deployment."""
    knobs: dict[str, Any] = {
        "idle_hold_s": settings.scale_idle_hold_s,
        "warm_keep_s": settings.scale_warm_keep_s,
        "warm_cost": settings.scale_warm_cost,
        "standby_cost": settings.scale_standby_cost,
        "forecast_quantile": settings.scale_forecast_quantile,
    }
    period = settings.scale_profile_period_s
    if period != 86_400.0:  # a compressed day (tests, demos): the bins shrink alike ...
        # (no finer than two ticks: a bin a tick does not fill is noise) ...
        defaults = EmberConfig()
        bin_s = max(period / 144, 2.0 * defaults.tick_s)
        knobs |= {"profile_periods_s": (period, 7 * period), "profile_bin_s": bin_s}
        # ... and so do the autoscaler's memories, to no less than five ticks: a day of a
        # minute would otherwise remember a burst, or hold a step down, for longer than
        # the day.
        factor = period / 86_400.0
        for name in COMPRESSED_WINDOWS:
            seconds = knobs.get(name, getattr(defaults, name))
            knobs[name] = min(seconds, max(5.0 * defaults.tick_s, seconds * factor))
    return knobs


COMPRESSED_WINDOWS = (
    "level_tau_s", "trend_tau_s", "burst_decay_s", "stabilization_s", "burst_hold_s",
    "standby_keep_s", "surge_decay_s", "predict_horizon_s",
)  # fmt: skip
"""The ``EmberConfig`` memories a compressed day (``scale_profile_period_s``) shrinks: the
demand's level and trend, how long a burst is remembered or a step down held. The short
window the burst guard follows (``burst_tau_s``, 10 s) is about noise, not the day, and
stays."""


def _finite(x: float) -> float | None:
    """JSON has no NaN or infinity: ``None`` for those."""
    return round(x, 6) if math.isfinite(x) else None
