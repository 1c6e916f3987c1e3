"""Per-tenant quotas: what one tenant may hold of the platform's shared capacity.

Each quota's default is a setting (``EMBER_QUOTA_*``, and ``EMBER_JOBS_TENANT_MAX_QUEUED_JOBS``
for queued jobs); an admin overrides it per tenant (``Tenant.quotas``, ``PATCH
/v1/tenants/{name}``). A request that would take a tenant over one is refused before
anything is stored, with a problem naming the quota (``quota replicas exceeded: ...``):

* replicas, GPUs, CPU cores, memory: 403 on a deployment create or change. A deployment's
  worst case is what the pools controller may ever give it: ``max_replicas`` for the
  production version (the autoscaler keeps hot + warm + standby within it), a canary's
  share of the floor, one replica per fallback version (``PoolsController.desired``),
  times its placement. The controller never exceeds ``max_replicas``, so checking at
  deploy time bounds what runs; lowering a quota refuses growth but stops nothing.
* stored job bytes: 403 on submit (inputs and results of jobs not yet purged).
* queued jobs, batch runs in flight: 429 with ``Retry-After`` (they drain by themselves).
* control-plane requests per second: ``ember.api.ratelimit``.

Counting and storing are not one atomic step: requests racing each other may each pass,
so a tenant can go over by what it submits concurrently, never by more.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import func
from sqlmodel import Session, SQLModel, col, select

from ember.config import Settings
from ember.errors import BackPressure, QuotaExceeded
from ember.registry.schemas import PoolPolicy
from ember.registry.tables import BatchRun, Deployment, Job, JobStatus, Tenant

RETRY_AFTER_S = 10.0
"""``Retry-After`` of a refused job submission or batch run (they drain by themselves)."""
UNFINISHED_JOBS = (JobStatus.queued, JobStatus.running)


@dataclass(frozen=True, slots=True)
class Limits:
    """One tenant's quotas: the settings' defaults with its overrides applied."""

    tenant: str
    replicas: int
    gpus: int
    cpu_cores: float
    memory_gib: float
    queued_jobs: int
    job_bytes: int
    batch_runs: int
    requests_per_s: float


def defaults(settings: Settings) -> dict[str, Any]:
    return {
        "replicas": settings.quota_replicas,
        "gpus": settings.quota_gpus,
        "cpu_cores": settings.quota_cpu_cores,
        "memory_gib": settings.quota_memory_gib,
        "queued_jobs": settings.jobs_tenant_max_queued_jobs,
        "job_bytes": settings.quota_job_bytes,
        "batch_runs": settings.quota_batch_runs,
        "requests_per_s": settings.quota_requests_per_s,
    }


def resolve(settings: Settings, tenant: Tenant) -> Limits:
    values = defaults(settings)
    for name, value in (tenant.quotas or {}).items():
        if name in values and value is not None:
            values[name] = value
    return Limits(tenant=tenant.name, **values)


def limits_for(session: Session, settings: Settings, tenant_id: int) -> Limits:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:  # the principal's tenant was deleted under it
        return Limits(tenant="?", **dict.fromkeys(defaults(settings), 0))
    return resolve(settings, tenant)


# --- deployments ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a deployment (or a tenant's deployments) may hold at most."""

    replicas: int = 0
    gpus: int = 0
    cpu_cores: float = 0.0
    memory_gib: float = 0.0

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(
            *(getattr(self, f.name) + getattr(other, f.name) for f in fields(Footprint))
        )


UNITS = {"replicas": "replicas", "gpus": "GPUs", "cpu_cores": "CPU cores", "memory_gib": "GiB"}


def worst_replicas(
    policy: PoolPolicy, traffic: dict[str, int], production: str | None, fallback: list[str]
) -> int:
    """The most replicas the pools controller may give a deployment (mirrors
    ``PoolsController.desired`` and the autoscaler's ``max_replicas`` cap)."""
    floor = policy.hot_floor
    total = 0
    routed = [v for v, weight in traffic.items() if weight > 0]
    for version in routed:
        if version == production:
            total += policy.max_replicas
        else:  # a canary: its share of the floor, at least one (a request wakes it)
            share = max(1, math.ceil(floor * traffic[version] / 100))
            total += min(policy.max_replicas, share)
    return total + sum(1 for v in dict.fromkeys(fallback) if v not in routed)


def footprint(deployment: Deployment) -> Footprint:
    policy = PoolPolicy.model_validate(deployment.policy)
    replicas = worst_replicas(
        policy,
        deployment.traffic or {},
        (deployment.aliases or {}).get("production"),
        list(deployment.fallback or []),
    )
    place = policy.placement
    return Footprint(
        replicas=replicas,
        gpus=replicas * (place.gpus if place.accelerator else 0),
        cpu_cores=replicas * place.cpu_cores,
        memory_gib=replicas * place.memory_gib,
    )


def check_deployment(
    session: Session, limits: Limits, deployment: Deployment, before: Footprint | None
) -> None:
    """Refuse (403) a deployment whose worst case takes its tenant's deployments over a
    quota. ``before``: its footprint before this change (None: it is new); a change that
    does not grow a total past its quota is let through (a quota lowered below what the
    tenant already holds refuses growth only)."""
    others = Footprint()
    query = select(Deployment).where(Deployment.tenant_id == deployment.tenant_id)
    if deployment.id is not None:
        query = query.where(col(Deployment.id) != deployment.id)
    with session.no_autoflush:
        for row in session.exec(query):
            others = others + footprint(row)
    after = others + footprint(deployment)
    held = others + (before or Footprint())
    for name, unit in UNITS.items():
        need, limit = getattr(after, name), getattr(limits, name)
        if need > limit and need > getattr(held, name):
            raise QuotaExceeded(
                f"quota {name} exceeded: deployments would need {need:g} {unit}, tenant "
                f"{limits.tenant!r} may hold {limit:g}",
                quota=name,
                limit=limit,
                requested=need,
            )


# --- jobs and batch runs ----------------------------------------------------------------


def inline_bytes(instances: list[Any]) -> int:
    """What inline job inputs take in the registry (their JSON)."""
    return len(json.dumps(instances, separators=(",", ":")).encode())


def _count(session: Session, table: type[SQLModel], *where: Any) -> int:
    """The rows of ``table`` matching ``where``."""
    return int(session.exec(select(func.count()).select_from(table).where(*where)).one())


def check_jobs(session: Session, limits: Limits, tenant_id: int, input_bytes: int) -> None:
    """Queued jobs (429) and stored job bytes (403) for one more job."""
    queued = _count(session, Job, Job.tenant_id == tenant_id, col(Job.status).in_(UNFINISHED_JOBS))
    if queued + 1 > limits.queued_jobs:
        raise BackPressure(
            f"quota queued_jobs exceeded: tenant {limits.tenant!r} has {queued} unfinished "
            f"jobs and may have {limits.queued_jobs}",
            retry_after_s=RETRY_AFTER_S,
            quota="queued_jobs",
            queued_jobs=queued,
        )
    kept = func.coalesce(func.sum(Job.input_bytes), 0) + func.coalesce(
        func.sum(Job.result_bytes), 0
    )
    stored = int(
        session.exec(
            select(kept).where(Job.tenant_id == tenant_id, col(Job.purged_at).is_(None))
        ).one()
        or 0
    )
    if stored + input_bytes > limits.job_bytes:
        raise QuotaExceeded(
            f"quota job_bytes exceeded: tenant {limits.tenant!r} keeps {stored} bytes of "
            f"job inputs and results, this job adds {input_bytes} and the tenant may keep "
            f"{limits.job_bytes} (finished jobs' are purged after EMBER_JOBS_RESULT_TTL_S)",
            quota="job_bytes",
            limit=limits.job_bytes,
            requested=stored + input_bytes,
        )


def check_batch_runs(session: Session, limits: Limits, tenant_id: int) -> None:
    """Batch runs in flight (429) for one more run."""
    running = _count(
        session, BatchRun, BatchRun.tenant_id == tenant_id, BatchRun.status == "running"
    )
    if running + 1 > limits.batch_runs:
        raise BackPressure(
            f"quota batch_runs exceeded: tenant {limits.tenant!r} has {running} batch runs "
            f"in flight and may have {limits.batch_runs}",
            retry_after_s=RETRY_AFTER_S,
            quota="batch_runs",
        )
