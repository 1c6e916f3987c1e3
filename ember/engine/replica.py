"""One replica's state: which version it serves, its tier, its engine and scheduler."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from ember.config import Settings
from ember.domain.spec import BatchPolicy, Priority, Tier, VersionSpec
from ember.engine.base import Engine, engine_class
from ember.engine.heap import frozen_after, gc_state
from ember.engine.metrics import EngineMetrics
from ember.engine.privileges import drop_to, tenant_home
from ember.engine.scheduler import Scheduler
from ember.engine.threads import CpuBudget, apply_thread_limits
from ember.errors import Conflict, EmberError, NotReady
from ember.loader.cache import tenant_cache_dir
from ember.loader.pagecache import RESERVE
from ember.logs import bind_process, get_logger

log = get_logger(__name__)
PROBE_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class Tenancy:
    """Whose version a standby process is assigned (``POST /assign``'s query)."""

    tenant_id: int
    uid: int | None = None
    """Drop to this uid first (a standby process started as root); None: stay."""
    gid: int | None = None


class Replica:
    def __init__(
        self,
        settings: Settings,
        policy: BatchPolicy,
        device: str = "cpu",
        replica_id: str | None = None,
        threads: int | None = None,
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.threads = threads
        """The model's CPU threads (None: not set by Ember)."""
        self.device = device
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.spec: VersionSpec | None = None
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.metrics: EngineMetrics | None = None
        self.state = "standby"
        """standby (no version) → loading → ready | failed."""
        self.failure: str | None = None
        self.load_seconds: float | None = None
        bind_process(replica_id=self.replica_id)

    @property
    def tier(self) -> Tier:
        return self.engine.tier if self.engine else Tier.standby

    async def assign(
        self,
        spec: VersionSpec,
        policy: dict[str, Any] | None = None,
        threads: int | None = None,
        tenant: Tenancy | None = None,
    ) -> None:
        """Load ``spec`` (a standby process becomes this version's replica). ``policy``
        (BatchPolicy fields) and ``threads`` are the deployment's, for a standby process
        started before anyone knew which deployment it would serve; ``tenant``: whose
        version it is (its cache directory, its home, the uid to drop to first)."""
        if self.spec is not None:
            raise Conflict(f"replica already serves {self.spec.model}:{self.spec.version}")
        if tenant is not None:
            try:
                self._enter_tenant(tenant)
            except OSError as exc:
                self.state, self.failure = "failed", f"cannot become the tenant's user: {exc}"
                log.error("assign failed", reason=self.failure)
                return
        if policy:
            self.policy = BatchPolicy.model_validate(self.policy.model_dump() | policy)
        if threads is not None and threads != self.threads:
            apply_thread_limits(CpuBudget(threads, "assigned"))
            self.threads = threads
        self.spec, self.state = spec, "loading"
        bind_process(model=spec.model, version=spec.version)
        self.metrics = EngineMetrics(spec.model, spec.version)
        started = time.perf_counter()
        try:
            with frozen_after():  # the engine's objects live as long as the replica
                self.engine = await asyncio.to_thread(self._build, spec)
        except EmberError as exc:
            self.state, self.failure = "failed", f"{exc.title}: {exc.detail}"
            log.error("load failed", reason=self.failure)
            return
        except Exception as exc:
            self.state, self.failure = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("load failed")
            return
        self.load_seconds = time.perf_counter() - started
        self.scheduler = Scheduler(self.engine, self.policy, self.metrics)
        self.scheduler.start()
        self.state = "ready"
        log.info("replica ready", tier=self.tier.value, load_s=round(self.load_seconds, 3))

    def _enter_tenant(self, tenant: Tenancy) -> None:
        """Become the tenant's: drop to its uid (irreversibly, before anything of the
        version is read or imported), then use its weight cache and home."""
        if tenant.uid is not None:
            drop_to(tenant.uid, tenant.gid if tenant.gid is not None else tenant.uid)
        cache = tenant_cache_dir(self.settings.weight_cache_dir, tenant.tenant_id)
        self.settings = self.settings.model_copy(update={"cache_dir": cache})
        home = tenant_home(self.settings.data_dir, tenant.tenant_id)
        os.environ["HOME"] = str(home)
        with suppress(OSError):
            os.chdir(home)

    def _build(self, spec: VersionSpec) -> Engine:
        try:
            engine = engine_class(spec.engine)(spec, self.settings, self.device)
            engine.load()
            return engine
        finally:
            RESERVE.release()  # what the load did not take (weights mapped, or none read)

    async def set_tier(self, tier: Tier) -> None:
        engine = self._require_engine()
        if tier is not engine.tier:
            started = time.perf_counter()
            await asyncio.to_thread(engine.set_tier, tier)
            log.info(
                "tier changed", tier=tier.value, seconds=round(time.perf_counter() - started, 3)
            )

    async def infer(
        self,
        instances: list[Any],
        priority: Priority,
        timeout_ms: float | None,
        timing: dict[str, float] | None = None,
    ) -> list[Any]:
        return await self._hot_scheduler().submit(instances, priority, timeout_ms, timing)

    async def infer_tensor(
        self,
        array: Any,
        priority: Priority,
        timeout_ms: float | None,
        timing: dict[str, float] | None = None,
    ) -> list[Any]:
        """``infer`` for a tensor body (one array, instances along its first dimension)."""
        return await self._hot_scheduler().submit_tensor(array, priority, timeout_ms, timing)

    def _hot_scheduler(self) -> Scheduler:
        engine = self._require_engine()
        if engine.tier is not Tier.hot or self.scheduler is None:
            raise NotReady(
                f"replica is {engine.tier.value}; promote it to hot first", tier=engine.tier.value
            )
        return self.scheduler

    async def probe(self) -> None:
        """A tiny real forward pass at health priority (jumps every queue)."""
        engine = self._require_engine()
        if engine.tier is Tier.hot and self.scheduler is not None:
            await self.scheduler.submit([engine.probe()], Priority.health, PROBE_TIMEOUT_MS)

    def _require_engine(self) -> Engine:
        if self.state == "failed":
            raise NotReady(f"replica failed to load: {self.failure}", state=self.state)
        if self.engine is None:
            raise NotReady(f"replica is {self.state}", state=self.state)
        return self.engine

    def info(self) -> dict[str, Any]:
        report = getattr(self.engine, "load_report", None) if self.engine else None
        return {
            "replica_id": self.replica_id,
            "state": self.state,
            "tier": self.tier.value,
            "model": self.spec.model if self.spec else None,
            "version": self.spec.version if self.spec else None,
            "sha256": self.spec.sha256 if self.spec else None,
            "failure": self.failure,
            "load_s": self.load_seconds,
            "load_report": report.as_dict() if report is not None else None,
            "queued": self.scheduler.queued if self.scheduler else 0,
            "inflight_units": self.scheduler.inflight_units if self.scheduler else 0.0,
            "policy": self.policy.model_dump(),
            "threads": self.threads,
            "reserve": {"bytes": RESERVE.nbytes, "ready": RESERVE.ready},
            "gc": gc_state(),
        }

    async def close(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.stop()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)
