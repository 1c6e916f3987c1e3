"""The pools controller: a reconcile loop that keeps each deployment's replicas as they
should be, and the routing table the gateway reads.

Every tick it reads the deployments from the registry, reaps replicas whose process
exited, promotes ``starting`` replicas that answer ``/readyz``, probes idle ready
replicas through ``/healthz`` (killing and replacing those that stop answering), starts
what is missing (taking a standby process when one is ready), retires versions that no
longer get traffic once the new ones are ready, and keeps a small standby pool.
All process calls go through the ``ReplicaBackend``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import Engine
from sqlmodel import select

from ember.costmodel import CostModel, hardware_key
from ember.errors import NotReady
from ember.logs import get_logger, model_context
from ember.pools.backends.base import LaunchOptions, ReplicaBackend, ReplicaHandle
from ember.pools.metrics import PoolMetrics
from ember.pools.router import Route
from ember.registry import catalog
from ember.registry.db import session_scope
from ember.registry.schemas import PoolPolicy
from ember.registry.tables import Deployment, Model, ModelVersion, VersionStatus

log = get_logger(__name__)


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

    def public(self) -> dict[str, Any]:
        return {
            "replica_id": self.handle.replica_id,
            "model": self.model,
            "version": self.version,
            "state": self.state,
            "tier": self.tier,
            "reason": self.reason,
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

    def cost(self, version: str) -> CostModel:
        return CostModel.from_dict(self.specs.get(version, {}).get("cost"))


class PoolsController:
    def __init__(
        self,
        db: Engine,
        backend: ReplicaBackend,
        *,
        standby_pool: int = 1,
        probe: ProbeSettings | None = None,
        tick_s: float = 0.25,
        max_restarts: int = 3,
    ) -> None:
        self.db = db
        self.backend = backend
        self.standby_pool = standby_pool
        self.probe_settings = probe or ProbeSettings()
        self.tick_s = tick_s
        self.max_restarts = max_restarts
        self.replicas: dict[str, ManagedReplica] = {}
        self.deployments: dict[tuple[int, str], DeploymentView] = {}
        self.failures: dict[tuple[tuple[int, str], str], int] = {}
        self.events: list[dict[str, Any]] = []
        self.metrics = PoolMetrics()
        self.hardware = hardware_key("cpu")
        self._http = httpx.AsyncClient(timeout=self.probe_settings.timeout_s)
        self._task: asyncio.Task[None] | None = None
        self._assigning: set[asyncio.Task[None]] = set()

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ember-pools")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for replica in list(self.replicas.values()):
            await asyncio.to_thread(self.backend.stop, replica.handle, 5.0)
        await self._http.aclose()

    async def _run(self) -> None:
        while True:
            try:
                await self.reconcile()
            except Exception:  # a bad tick must not stop the controller
                log.exception("reconcile failed")
            await asyncio.sleep(self.tick_s)

    async def reconcile(self) -> None:
        self.deployments = await asyncio.to_thread(self._read_registry)
        self._reap_exited()
        await self._check_starting()
        await self._probe_idle()
        self._scale()
        await self._retire()
        self._keep_standby()
        self.metrics.observe(self)

    # --- registry -----------------------------------------------------------------------

    def _read_registry(self) -> dict[tuple[int, str], DeploymentView]:
        views: dict[tuple[int, str], DeploymentView] = {}
        with session_scope(self.db) as session:
            for d in session.exec(select(Deployment)):
                model = session.get(Model, d.model_id)
                if model is None:
                    continue
                wanted = {v for v, w in d.traffic.items() if w > 0} | set(d.fallback)
                rows = session.exec(
                    select(ModelVersion).where(
                        ModelVersion.model_id == model.id, ModelVersion.version.in_(wanted)
                    )
                )  # type: ignore[attr-defined]
                specs = {
                    r.version: catalog.version_spec(model, r, self.hardware)
                    for r in rows
                    if r.status is VersionStatus.ready
                }
                views[(d.tenant_id, d.name)] = DeploymentView(
                    d.tenant_id,
                    d.name,
                    model.name,
                    dict(d.traffic),
                    PoolPolicy.model_validate(d.policy),
                    specs,
                    list(d.fallback),
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
        self.backend.kill(replica.handle)  # nothing to drain, and a hung one gets no grace
        self.replicas.pop(replica.handle.replica_id, None)
        if replica.key[1]:
            key = (replica.key, replica.version)
            self.failures[key] = self.failures.get(key, 0) + 1
        self._event("failed", replica, reason=reason)

    def _reap_exited(self) -> None:
        for replica in list(self.replicas.values()):
            status = self.backend.exited(replica.handle)
            if status is not None:
                self.metrics.replaced.labels(reason="exited").inc()
                self._fail(replica, f"process exited with status {status}")

    async def _check_starting(self) -> None:
        starting = [r for r in self.replicas.values() if r.state == "starting"]
        await asyncio.gather(*(self._check_one(r) for r in starting))

    async def _check_one(self, replica: ManagedReplica) -> None:
        try:
            info = (await self._http.get(f"{replica.handle.url}/info")).json()
        except (httpx.HTTPError, ValueError):
            return  # not listening yet
        if info.get("state") == "failed":
            self._fail(replica, info.get("failure") or "load failed")
            return
        want = "standby" if not replica.key[1] else "ready"
        if info.get("state") == want and (want == "standby" or info.get("tier") == "hot"):
            replica.state = "ready" if replica.key[1] else "standby"
            replica.ready_at = time.monotonic()
            replica.last_ok = replica.ready_at
            if replica.key[1]:
                replica.route = Route(
                    replica.handle.replica_id, replica.handle.url, replica.version
                )
                took = replica.ready_at - replica.started_at
                self.metrics.cold_start.labels(
                    model=replica.model, version=replica.version
                ).observe(took)
                self.failures.pop((replica.key, replica.version), None)
            self._event("ready", replica, startup_s=round(replica.ready_at - replica.started_at, 3))

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
            self.metrics.detect_seconds.observe(detected)
            self.metrics.replaced.labels(reason="probe").inc()
            self._fail(replica, f"failed {replica.probe_failures} health probes")
            self._event("killed", replica, detected_after_s=round(detected, 3))

    def mark_ok(self, replica_id: str) -> None:
        """The gateway saw a real request succeed: no probe needed for a while."""
        replica = self.replicas.get(replica_id)
        if replica is not None:
            replica.last_ok = time.monotonic()

    # --- scaling ------------------------------------------------------------------------

    def desired(self, view: DeploymentView) -> dict[str, int]:
        """Hot replicas per version: the floor for production, a share for a canary."""
        total = max(view.policy.min_hot, 1)
        out: dict[str, int] = {}
        for version, weight in view.traffic.items():
            if weight > 0 and version in view.specs:
                out[version] = max(
                    1, min(view.policy.max_replicas, math.ceil(total * weight / 100))
                )
        return out

    def _scale(self) -> None:
        for key, view in self.deployments.items():
            for version, want in self.desired(view).items():
                have = [
                    r
                    for r in self.replicas.values()
                    if r.key == key and r.version == version and r.state in ("starting", "ready")
                ]
                if self.failures.get((key, version), 0) >= self.max_restarts:
                    continue  # crash-looping: leave it failed (visible in /replicas) until changed
                for _ in range(want - len(have)):
                    self._start(view, version)

    def _start(self, view: DeploymentView, version: str) -> None:
        spec = view.specs[version]
        options = LaunchOptions(view.policy.max_batch_size, view.policy.max_queue_delay_ms)
        standby = next((r for r in self.replicas.values() if r.state == "standby"), None)
        if standby is not None:
            del self.replicas[standby.handle.replica_id]
            replica = ManagedReplica(
                standby.handle, (view.tenant_id, view.name), view.model, version
            )
            self.replicas[replica.handle.replica_id] = replica
            task = asyncio.get_running_loop().create_task(self._assign(replica, spec))
            self._assigning.add(task)
            task.add_done_callback(self._assigning.discard)
            self._event("assigned", replica, from_tier="standby")
            return
        handle = self.backend.launch(spec, options)
        replica = ManagedReplica(handle, (view.tenant_id, view.name), view.model, version)
        self.replicas[handle.replica_id] = replica
        self._event("starting", replica, pid=handle.pid, port=handle.port)

    async def _assign(self, replica: ManagedReplica, spec: dict[str, Any]) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self._http.post(f"{replica.handle.url}/assign", json=spec, timeout=600)

    def _keep_standby(self) -> None:
        spares = [r for r in self.replicas.values() if not r.key[1]]
        for _ in range(self.standby_pool - len(spares)):
            handle = self.backend.launch(None, LaunchOptions())
            replica = ManagedReplica(handle, (0, ""), "", "", tier="standby")
            self.replicas[handle.replica_id] = replica
            self._event("starting", replica, standby=True, pid=handle.pid)

    async def _retire(self) -> None:
        """Stop replicas whose deployment or version no longer serves — but only once every
        version that does serve has its replicas ready, so a rollout never leaves a gap."""
        for replica in list(self.replicas.values()):
            if not replica.key[1] or replica.state == "draining":
                continue
            view = self.deployments.get(replica.key)
            if view is not None and replica.version in self.desired(view):
                continue
            if view is not None and not self._all_ready(view):
                continue
            replica.state = "draining"
            self._event("draining", replica)
            task = asyncio.get_running_loop().create_task(self._drain(replica))
            self._assigning.add(task)
            task.add_done_callback(self._assigning.discard)

    def _all_ready(self, view: DeploymentView) -> bool:
        key = (view.tenant_id, view.name)
        return all(
            any(
                r.key == key and r.version == v and r.state == "ready"
                for r in self.replicas.values()
            )
            for v in self.desired(view)
        )

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
            if r.key == key and r.version == version and r.state == "ready" and r.route
        ]

    def routable_traffic(self, view: DeploymentView) -> dict[str, int]:
        """The deployment's weights over versions that have a ready replica; while a new
        version loads, the versions still running keep serving."""
        key = (view.tenant_id, view.name)
        ready = {v: w for v, w in view.traffic.items() if w > 0 and self.routes(key, v)}
        if ready:
            return ready
        running = {r.version for r in self.replicas.values() if r.key == key and r.state == "ready"}
        if running:
            return {v: 1 for v in sorted(running)}
        raise NotReady(f"deployment {view.name!r} has no ready replica yet", deployment=view.name)

    def replicas_of(self, key: tuple[int, str]) -> list[dict[str, Any]]:
        return [r.public() for r in self.replicas.values() if r.key == key]
