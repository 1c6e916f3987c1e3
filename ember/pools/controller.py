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

import httpx
from sqlalchemy import Engine, func
from sqlalchemy import select as sa_select
from sqlmodel import col, select

from ember.costmodel import CostModel, hardware_key
from ember.errors import NotReady
from ember.loader.pagecache import whole_huge_pages
from ember.logs import get_logger, model_context
from ember.pools.autoscaler import (
    Autoscaler,
    EmberConfig,
    EmberState,
    Observation,
    PromotionTimes,
    StandbyPoolConfig,
    StandbyPoolState,
    TierCounts,
    ember_autoscaler,
    size_standby_pool,
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
from ember.pools.metrics import PoolMetrics
from ember.pools.plan import (
    Actions,
    Inventory,
    Target,
    all_ready,
    hot_target,
    plan,
    standby_pool_size,
)
from ember.pools.router import Route
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
    key: tuple[int, str]
    """(tenant id, deployment name); standby processes have (0, "")."""
    model: str
    version: str
    state: str = "starting"
    tier: str = "hot"
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
    source: str = "cold"
    """How it was started: ``cold`` (a new process) or ``standby`` (a standby one assigned)."""
    then_tier: str | None = None
    """``warm``: a warm spare started from nothing, demoted to warm once loaded."""
    queued: str | None = None
    """Why the backend has not started it yet (waiting for GPUs): ``starting`` to the
    controller (counted as on its way), ``queued`` with this reason in its listing."""

    def public(self) -> dict[str, Any]:
        return {
            "replica_id": self.handle.replica_id,
            "model": self.model,
            "version": self.version,
            "state": "queued" if self.queued else self.state,
            "tier": self.tier,
            "reason": self.queued or self.reason,
            "pid": self.handle.pid,
            "port": self.handle.port,
            "url": self.handle.url,
            "inflight_units": self.route.inflight_units if self.route else 0.0,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
        }


@dataclass
class DeploymentView:
    tenant_id: int
    name: str
    model: str
    traffic: dict[str, int]
    policy: PoolPolicy
    specs: dict[str, dict[str, Any]]
    fallback: list[str]
    pinned: list[str] = field(default_factory=list)
    """Versions that running batch runs were pinned to: served (one hot replica each)
    until those runs end, even after a promote moved the traffic elsewhere."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Artifact bytes per version (where known)."""

    _costs: dict[str, CostModel] = field(default_factory=dict, init=False, repr=False,
                                         compare=False)  # fmt: skip

    def cost(self, version: str) -> CostModel:
        """The version's cost model (made once per view: the gateway asks per request)."""
        model = self._costs.get(version)
        if model is None:
            model = CostModel.from_dict(self.specs.get(version, {}).get("cost"))
            self._costs[version] = model
        return model

    @property
    def production(self) -> str | None:
        """The version with the most traffic (ties: the highest name)."""
        live = [(w, v) for v, w in self.traffic.items() if w > 0 and v in self.specs]
        return max(live)[1] if live else None

    def capacity_units_per_s(self, version: str) -> float:
        """One hot replica's throughput: calibrated, else assume a full batch per second."""
        if self.specs.get(version, {}).get("cost"):
            return self.cost(version).capacity_units_per_s
        return float(self.policy.max_batch_size) * self.cost(version).cost(1)


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
    ) -> None:
        self.db = db
        self.standby_reserve_max = standby_reserve_max
        """Host memory a standby process faults in ahead, at most (``_standby_reserve``)."""
        self.backend = backend
        self.leader = leader
        self.leading = leader is None
        self._lease_checked = -math.inf
        self.standby_pool = standby_pool
        """Standby processes kept now: the floor, grown by ``_standby_asked``."""
        self.standby_floor = standby_pool
        self.standby_max = standby_pool if standby_max is None else standby_max
        self.standby_state = StandbyPoolState()
        self.standby_spawn_s: list[float] = []
        """Seconds a standby process took to be ready (the last 50): the pool's refill time."""
        self.probe_settings = probe or ProbeSettings()
        self.tick_s = tick_s
        self.max_restarts = max_restarts
        self.replicas: dict[str, ManagedReplica] = {}
        self.deployments: dict[tuple[int, str], DeploymentView] = {}
        self.failures: dict[tuple[tuple[int, str], str], int] = {}
        self.events: list[dict[str, Any]] = []
        self.metrics = PoolMetrics()
        backend.register_metrics(self.metrics.registry)
        self.hardware = hardware_key("cpu")
        self._http = httpx.AsyncClient(timeout=self.probe_settings.timeout_s)
        self._task: asyncio.Task[None] | None = None
        self._assigning: set[asyncio.Task[None]] = set()
        # The predictive autoscaler (the same code the simulator replays) per production
        # version, fed with what the gateway saw since the last step.
        self.scalers: dict[tuple[tuple[int, str], str], Autoscaler[EmberState, EmberConfig]] = {}
        self.targets: dict[tuple[tuple[int, str], str], TierCounts] = {}
        self.demand: dict[tuple[tuple[int, str], str], list[float]] = {}
        # Seconds to serving, per tier promoted from (the last 50 of each): the autoscaler's
        # lead is their p95 (PromotionTimes' measured defaults until a tier has samples).
        self.promotion_s: dict[str, list[float]] = {"warm": [], "standby": [], "cold": []}
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
        self.woken: dict[tuple[tuple[int, str], str], float] = {}
        self.registry_every_s = 1.0
        self._last_read = self._last_full_read = -math.inf
        self._fingerprint: tuple[Any, ...] | None = None
        self._last_step = time.monotonic()
        # The job queue's hook (ember.jobs.demand): (tenant id, deployment) -> model units
        # of unfinished async jobs, read in a thread with the registry; added to the
        # production version's queued units, so a backlog scales the pool to drain it.
        self.async_demand: Callable[[], dict[tuple[int, str], float]] | None = None
        # Several API processes (a leader election): followers push the demand their
        # gateways counted, the leader adds it to its own before each autoscaler step.
        self.shared_demand: SharedDemand | None = None
        self.async_queued: dict[tuple[int, str], float] = {}
        # The autoscalers' state (a learned daily profile) in Redis: saved every
        # ``state_every_s``, restored by whichever controller acts next (restart, new leader).
        self.forecast_store: ForecastStore | None = None
        self.state_every_s = 10.0
        self._state_saved = time.monotonic()
        # The shared warm tier (local backend, EMBER_WARM_SET_BYTES): versions with no ready
        # replica held in host RAM, so a standby process loads them from the page cache.
        self.warm_tier: SharedWarmTier | None = None
        # What the dashboard plots (ember.pools.history): sampled by the acting controller.
        self.history: History | None = None

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
        await self._http.aclose()
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
            if replica.state == "ready" and replica.handle.replica_id not in ready:
                replica.state, replica.route = "starting", None  # demoted, draining, unready
        await asyncio.gather(
            *(
                self._check_one(r)
                for r in self.replicas.values()
                if r.state == "starting" and r.handle.replica_id in ready
            )
        )
        self.metrics.observe(self)

    def _sync_observed(self, observed: list[ObservedReplica], prune: bool) -> None:
        """Track replicas found in the backend (``starting`` until ``/info`` tells their
        state); with ``prune``, forget tracked ones that are no longer there."""
        seen = set()
        for o in observed:
            seen.add(o.handle.replica_id)
            if o.handle.replica_id not in self.replicas:
                key, tier = (o.tenant_id, o.deployment), "hot" if o.deployment else "standby"
                replica = ManagedReplica(o.handle, key, o.model, o.version, tier=tier)
                replica.adopted = True
                self.replicas[o.handle.replica_id] = replica
        if prune:
            for replica_id in set(self.replicas) - seen:
                self.replicas.pop(replica_id)

    # --- registry -----------------------------------------------------------------------

    def _read_registry(self) -> dict[tuple[int, str], DeploymentView]:
        views: dict[tuple[int, str], DeploymentView] = {}
        with session_scope(self.db) as session:
            pins: dict[tuple[int, str], set[str]] = {}
            for run in session.exec(select(BatchRun).where(BatchRun.status == "running")):
                pins.setdefault((run.tenant_id, run.deployment), set()).add(run.version)
            tenants = {t.id: t for t in session.exec(select(Tenant)) if t.id is not None}
            self.metrics.tenant_names = {i: t.name for i, t in tenants.items()}
            for d in session.exec(select(Deployment)):
                model = session.get(Model, d.model_id)
                if model is None:
                    continue
                pinned = pins.get((d.tenant_id, d.name), set())
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
                    r.version: catalog.version_spec(model, r, self.hardware) | trusted for r in rows
                }
                views[(d.tenant_id, d.name)] = DeploymentView(
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
            "tenant_id": replica.key[0],
            "deployment": replica.key[1],
            "at": time.time(),
            **fields,
        }
        self.events = [*self.events[-199:], event]
        with model_context(replica.model, replica.version, replica_id=replica.handle.replica_id):
            log.info(f"replica {kind}", **fields)

    def _fail(self, replica: ManagedReplica, reason: str) -> None:
        replica.state, replica.reason = "failed", reason
        if self.leading:  # a follower only forgets it; the acting controller replaces it
            self.backend.kill(replica.handle)  # nothing to drain, a hung one gets no grace
        self.replicas.pop(replica.handle.replica_id, None)
        if replica.key[1]:
            key = (replica.key, replica.version)
            self.failures[key] = self.failures.get(key, 0) + 1
        self._event("failed", replica, reason=reason)

    def _reap_exited(self) -> None:
        for replica in list(self.replicas.values()):
            if replica.state == "draining":  # being stopped: its exit is the plan, no failure
                continue
            status = self.backend.exited(replica.handle)
            if status is not None:
                self.metrics.replaced.labels(*self.metrics.of_replica(replica), "exited").inc()
                reason = self.backend.exit_reason(replica.handle)
                self._fail(replica, reason or f"process exited with status {status}")

    async def _check_starting(self) -> None:
        starting = [r for r in self.replicas.values() if r.state == "starting"]
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
        try:
            url, auth = f"{replica.handle.url}/info", replica.handle.auth
            info = (await self._http.get(url, headers=auth)).json()
        except (httpx.HTTPError, ValueError):
            return  # not listening yet
        if info.get("state") == "failed":
            self._fail(replica, info.get("failure") or "load failed")
            return
        want = "standby" if not replica.key[1] else "ready"
        if replica.adopted and want == "ready" and info.get("state") == want:
            replica.tier = str(info.get("tier") or "hot")  # a warm one stays warm
        if info.get("state") == want and (want == "standby" or info.get("tier") == replica.tier):
            replica.state = "ready" if replica.key[1] else "standby"
            replica.ready_at = time.monotonic()
            replica.last_ok = replica.ready_at
            if not replica.key[1] and not replica.adopted:
                spawn = replica.ready_at - replica.started_at
                self.standby_spawn_s = [*self.standby_spawn_s[-49:], spawn]
            if (replica.key, replica.version) in self.woken:  # serve the wake-up, then scale
                idle_hold = self.autoscale_knobs.get("idle_hold_s", WAKE_HOLD_S)
                self.woken[(replica.key, replica.version)] = replica.ready_at + idle_hold
            if replica.key[1] and replica.tier == "hot" and replica.then_tier == "warm":
                replica.then_tier = None  # a warm spare: loaded, now demoted (not routed)
                self._change_tier(replica, "warm")
            elif replica.key[1] and replica.tier == "hot":
                replica.route = Route(
                    replica.handle.replica_id, replica.handle.url, replica.version,
                    secret=replica.handle.secret,
                )  # fmt: skip
            if replica.key[1] and not replica.adopted:
                took = replica.ready_at - replica.started_at
                self.metrics.cold_start.labels(*self.metrics.of_replica(replica)).observe(took)
                self._promoted(replica.source, took)
                self.failures.pop((replica.key, replica.version), None)
            self._event("ready", replica, startup_s=round(replica.ready_at - replica.started_at, 3),
                        load=(info.get("load_report") or {}).get("stages"))  # fmt: skip

    async def _probe_idle(self) -> None:
        now = time.monotonic()
        idle = [
            r
            for r in self.replicas.values()
            if r.state in ("ready", "standby") and now - r.last_ok >= self.probe_settings.idle_s
        ]
        await asyncio.gather(*(self._probe_one(r) for r in idle))

    async def _probe_one(self, replica: ManagedReplica) -> None:
        try:
            response = await self._http.get(f"{replica.handle.url}/healthz")
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
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
        key = (view.tenant_id, view.name)
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

    def inventory(self, key: tuple[int, str], version: str) -> Inventory:
        """The version's replicas by state, as :func:`~ember.pools.plan.plan` counts them."""
        mine = [r for r in self.replicas.values() if r.key == key and r.version == version]
        return Inventory(
            hot=sum(1 for r in mine if r.state == "ready" and r.tier == "hot"),
            warm=sum(1 for r in mine if r.state == "ready" and r.tier == "warm"),
            starting_hot=sum(
                1
                for r in mine
                if r.state == "promoting" or (r.state == "starting" and r.then_tier is None)
            ),
            promoting=sum(1 for r in mine if r.state == "promoting"),
            starting_warm=sum(1 for r in mine if r.state == "starting" and r.then_tier == "warm"),
            demoting=sum(1 for r in mine if r.state == "demoting"),
        )

    def plans(self, key: tuple[int, str]) -> dict[str, tuple[Inventory, Target, Actions]]:
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
        keys = set(self.deployments) | {r.key for r in self.replicas.values() if r.key[1]}
        for key in sorted(keys):
            for version, (_, _, actions) in self.plans(key).items():
                if actions:
                    self._act(key, version, actions)

    def _act(self, key: tuple[int, str], version: str, actions: Actions) -> None:
        mine = [r for r in self.replicas.values() if r.key == key and r.version == version]

        def least_busy(rs: list[ManagedReplica]) -> list[ManagedReplica]:
            return sorted(
                rs, key=lambda r: (r.route.inflight_units if r.route else 0.0, -r.started_at)
            )

        hot = least_busy([r for r in mine if r.state == "ready" and r.tier == "hot"])
        warm = least_busy([r for r in mine if r.state == "ready" and r.tier == "warm"])
        loading = [r for r in mine if r.state == "starting" and r.then_tier == "warm"]
        for replica in warm[: actions.promote]:
            self._change_tier(replica, "hot")
        for replica in loading[: actions.keep_hot]:
            replica.then_tier = None
        view = self.deployments.get(key)
        if view is not None and version in view.specs:
            for _ in range(actions.start_hot):
                self._start(view, version)
            for _ in range(actions.start_warm):
                self._start(view, version, then_tier="warm")
        for replica in hot[: actions.demote]:
            self._change_tier(replica, "warm")
        stops = hot[actions.demote : actions.demote + actions.stop_hot]
        stops += warm[actions.promote : actions.promote + actions.stop_warm]
        # Warm spares still loading first, the newest (the last to be ready) first.
        on_the_way = sorted(
            (r for r in mine if r.state in ("starting", "promoting", "demoting")),
            key=lambda r: (r.then_tier != "warm" or r.state != "starting", -r.started_at),
        )
        stops += on_the_way[: actions.stop_starting]
        starts = [r for r in mine if r.state == "starting" and r.then_tier is None]
        stops += sorted(starts, key=lambda r: -r.started_at)[: actions.cancel_hot]
        for replica in stops:
            self._stop(replica)

    def _stop(self, replica: ManagedReplica) -> None:
        replica.state = "draining"
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
        between the floor and ``standby_max``."""
        if self.standby_max <= self.standby_floor or self.standby_floor == 0:
            return
        spawns = sorted(self.standby_spawn_s)
        refill = spawns[int(0.95 * (len(spawns) - 1))] if spawns else None
        cfg = StandbyPoolConfig(minimum=self.standby_floor)
        if refill is not None:
            cfg = StandbyPoolConfig(replenish_s=refill, minimum=self.standby_floor)
        size, self.standby_state = size_standby_pool(self.standby_state, cfg, time.monotonic())
        size = min(self.standby_max, size)
        if size > self.standby_pool:
            self.standby_pool = size
            event = {"event": "standby_pool", "size": size, "peak_asks": self.standby_state.peak,
                     "refill_s": round(cfg.replenish_s, 3), "tenant_id": 0, "deployment": "",
                     "at": time.time()}  # fmt: skip
            self.events = [*self.events[-199:], event]
            log.info("standby pool grown", size=size, peak_asks=self.standby_state.peak)

    def _promoted(self, tier: str, seconds: float) -> None:
        self.promotion_s[tier] = [*self.promotion_s[tier][-49:], seconds]

    def _promotion_times(self) -> PromotionTimes:
        """p95 of what each tier took here; a tier not yet measured keeps the default (the
        measured figures of ``bench/coldstart.py``), never above the next slower tier."""
        default = PromotionTimes()

        def p95(tier: str, otherwise: float) -> float:
            xs = sorted(self.promotion_s[tier])
            return xs[int(0.95 * (len(xs) - 1))] if xs else otherwise

        cold = p95("cold", default.cold_s)
        standby = p95("standby", min(default.standby_s, cold))
        return PromotionTimes(p95("warm", min(default.warm_s, standby)), standby, cold)

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
        self, key: tuple[int, str], view: DeploymentView, version: str, dt: float
    ) -> TierCounts:
        return (
            self.scaler(key, view, version).step(self.observation(key, view, version, dt)).desired
        )

    def scaler(
        self, key: tuple[int, str], view: DeploymentView, version: str
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
            for tier, xs in stored.items():  # what was learned before, then what is now
                self.promotion_s[tier] = [*xs, *self.promotion_s[tier]][-50:]
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

        promotion = {tier: list(xs) for tier, xs in self.promotion_s.items()}

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
        self, key: tuple[int, str], view: DeploymentView, version: str, dt: float
    ) -> Observation:
        """What the version saw over the last ``dt`` seconds (takes the gateway's count)."""
        mine = [r for r in self.replicas.values() if r.key == key and r.version == version]
        hot = [r for r in mine if r.state == "ready" and r.tier == "hot"]
        arrived, admitted = self.demand.pop((key, version), [0.0, 0.0])
        inflight = sum(r.route.inflight_units for r in hot if r.route)
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
                warm=sum(1 for r in mine if r.state == "ready" and r.tier == "warm"),
                standby=sum(1 for r in self.replicas.values() if r.state == "standby"),
            ),
            promoting=sum(
                1
                for r in mine
                if r.state == "promoting" or (r.state == "starting" and r.then_tier is None)
            ),
            promotion=self._promotion_times(),
        )

    def _change_tier(self, replica: ManagedReplica, tier: str) -> None:
        replica.state = "promoting" if tier == "hot" else "demoting"
        self._spawn(self._set_tier(replica, tier))

    async def _set_tier(self, replica: ManagedReplica, tier: str) -> None:
        started = time.monotonic()
        try:
            response = await self._http.post(
                f"{replica.handle.url}/tier", json={"tier": tier}, timeout=600,
                headers=replica.handle.auth,
            )  # fmt: skip
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok:
            self._fail(replica, f"tier change to {tier} failed")
            return
        replica.state, replica.tier, replica.last_ok = "ready", tier, time.monotonic()
        if tier == "hot":
            self._promoted("warm", time.monotonic() - started)
        self._event("tier", replica, tier=tier, seconds=round(time.monotonic() - started, 3))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._assigning.add(task)
        task.add_done_callback(self._assigning.discard)

    def _start(self, view: DeploymentView, version: str, *, then_tier: str | None = None) -> None:
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
                if r.state == "standby" and self.backend.standby_can_take(r.handle, spec, options)
            ),
            None,
        )
        if standby is not None:
            self.backend.assigned(standby.handle, spec, options)
            del self.replicas[standby.handle.replica_id]
            # A version the shared warm tier holds loads from host RAM: a warm promotion.
            held = self.warm_tier is not None and self.warm_tier.holds(
                view.model, version, str(spec.get("sha256") or "")
            )
            replica = ManagedReplica(
                standby.handle,
                (view.tenant_id, view.name),
                view.model,
                version,
                source="warm" if held else "standby",
                then_tier=then_tier,
            )
            self.replicas[replica.handle.replica_id] = replica
            task = asyncio.get_running_loop().create_task(self._assign(replica, spec, options))
            self._assigning.add(task)
            task.add_done_callback(self._assigning.discard)
            self._event(
                "assigned", replica, from_tier="standby", then_tier=then_tier, warm_set=held
            )
            return
        handle = self.backend.launch(spec, options)
        replica = ManagedReplica(
            handle, (view.tenant_id, view.name), view.model, version, then_tier=then_tier
        )
        self.replicas[handle.replica_id] = replica
        self._event("starting", replica, pid=handle.pid, port=handle.port, then_tier=then_tier)

    async def _assign(
        self, replica: ManagedReplica, spec: dict[str, Any], options: LaunchOptions
    ) -> None:
        """Give the standby process its version and the deployment's batch policy and
        threads (it was started with the defaults, before anyone knew its deployment)."""
        url, params = f"{replica.handle.url}/assign", options.replica_settings()
        params |= self.backend.assign_query(replica.handle, spec, options)
        with contextlib.suppress(httpx.HTTPError):
            await self._http.post(
                url, json=spec, params=params, timeout=600, headers=replica.handle.auth
            )

    def standby_wanted(self) -> int:
        """The shared standby pool's size (:func:`~ember.pools.plan.standby_pool_size`):
        what its asks sized it to, or the standby replicas the production versions'
        autoscalers want together, within ``[standby_floor, standby_max]``; none when the
        pool is turned off (a floor of 0)."""
        if self.standby_floor == 0:
            return 0
        wanted = sum(
            t.standby
            for (key, version), t in self.targets.items()
            if key in self.deployments and version == self.deployments[key].production
        )
        return standby_pool_size(
            self.standby_pool, wanted, floor=self.standby_floor, maximum=self.standby_max
        )

    def _keep_standby(self) -> None:
        spares = [r for r in self.replicas.values() if not r.key[1]]
        missing = self.standby_wanted() - len(spares)
        if missing <= 0:
            return
        options = LaunchOptions(reserve_bytes=self._standby_reserve())
        for _ in range(missing):
            handle = self.backend.launch(None, options)
            replica = ManagedReplica(handle, (0, ""), "", "", tier="standby")
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
        while replica.route and replica.route.inflight_units > 0 and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a counter the gateway owns
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.backend.stop, replica.handle)
        self.replicas.pop(replica.handle.replica_id, None)
        self._event("stopped", replica)

    # --- routing table ------------------------------------------------------------------

    def routes(self, key: tuple[int, str], version: str) -> list[Route]:
        return [
            r.route
            for r in self.replicas.values()
            if r.key == key
            and r.version == version
            and r.state == "ready"
            and r.tier == "hot"
            and r.route
        ]

    def coming(self, key: tuple[int, str], version: str) -> bool:
        """Whether a hot replica of ``version`` is on its way (starting, assigned, being
        promoted) or could be (a warm one the autoscaler promotes on demand). A
        ``scale_to_zero`` deployment holding nothing is woken here: a replica of the
        version starts at the next tick."""
        if any(
            r.key == key
            and r.version == version
            and (r.state in ("starting", "promoting") or (r.state == "ready" and r.tier == "warm"))
            for r in self.replicas.values()
        ):
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
            log.info("waking a scaled-to-zero deployment", deployment=key[1], version=version)
            self.woken[(key, version)] = now + WAKE_HOLD_S
        return True

    def routable_traffic(self, view: DeploymentView) -> dict[str, int]:
        """The deployment's weights over versions that have a ready replica; while a new
        version loads, the versions still running keep serving."""
        key = (view.tenant_id, view.name)
        ready = {v: w for v, w in view.traffic.items() if w > 0 and self.routes(key, v)}
        if ready:
            return ready
        running = {
            r.version
            for r in self.replicas.values()
            if r.key == key and r.state == "ready" and r.tier == "hot"
        } - ((set(view.fallback) | set(view.pinned)) - set(view.traffic))
        # (fallbacks answer only as the ladder; pinned versions only their runs)
        if running:
            return {v: 1 for v in sorted(running)}
        raise NotReady(f"deployment {view.name!r} has no ready replica yet", deployment=view.name)

    def replicas_of(self, key: tuple[int, str]) -> list[dict[str, Any]]:
        return [r.public() for r in self.replicas.values() if r.key == key]

    def autoscaler_of(self, key: tuple[int, str]) -> dict[str, Any]:
        """What the autoscaler of the deployment's production version forecast, wants per
        tier and why, the promotion times it plans with and its last decisions (for
        ``GET /v1/deployments/{name}/autoscaler``). ``acting`` is false on a controller
        that follows another (which decides; its view is the leader's to show)."""
        view = self.deployments.get(key)
        version = view.production if view is not None else None
        scaler = self.scalers.get((key, version)) if version is not None else None
        promotion = self._promotion_times()
        out: dict[str, Any] = {
            "version": version,
            "acting": self.leading,
            "promotion_s": {"warm": promotion.warm_s, "standby": promotion.standby_s,
                            "cold": promotion.cold_s},
            "promotion_samples": {t: len(v) for t, v in self.promotion_s.items()},
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
