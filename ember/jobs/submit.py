"""What the API does with a job: validate it, resolve its version, enforce idempotency and
the tenant's quota, store it, and publish its id.

Everything a worker could only discover minutes later — an unknown model or version, a
model that is not deployed, instances of the wrong shape, an ``input_uri`` that is not
the tenant's or not JSON, a private webhook address — is refused here with a
problem+json error.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from opentelemetry.trace import SpanKind
from sqlalchemy import Engine, func
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from ember import tracing
from ember.config import Settings
from ember.costmodel import CostModel, hardware_key
from ember.errors import BackPressure, Conflict, InvalidInput, NotFound
from ember.jobs import records, results, webhooks
from ember.jobs.queue import Publisher
from ember.jobs.schemas import JobCreate
from ember.logs import bound, get_logger
from ember.registry import quotas
from ember.registry.schemas import PoolPolicy
from ember.registry.tables import Job, JobStatus
from ember.registry.tenants import Principal
from ember.work.instances import check_instances
from ember.work.versions import resolve

log = get_logger(__name__)
QUOTA_RETRY_AFTER_S = 10.0


def request_digest(body: JobCreate) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_idempotency_key(key: str | None) -> str | None:
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not key.isascii() or not key.isprintable():
        raise InvalidInput("Idempotency-Key must be 1-255 printable ASCII characters")
    return key


def _existing(session: Session, tenant_id: int, key: str, digest: str) -> Job | None:
    job = session.exec(
        select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == key)
    ).first()
    if job is not None and job.request_sha256 != digest:
        raise Conflict(
            f"Idempotency-Key {key!r} was used for a different request (job {job.uid})",
            job_id=job.uid,
        )
    return job


def submit(
    session: Session,
    settings: Settings,
    publisher: Publisher,
    principal: Principal,
    body: JobCreate,
    idempotency_key: str | None,
) -> tuple[Job, bool]:
    """Store and publish a job; returns it and whether it is an idempotent replay."""
    key = check_idempotency_key(idempotency_key)
    if body.webhook_url is not None:
        webhooks.check_url(
            body.webhook_url, settings.jobs_webhook_allow_private, must_resolve=False
        )
    digest = request_digest(body)
    tenant_id = principal.tenant_id
    if key is not None and (found := _existing(session, tenant_id, key, digest)) is not None:
        return found, True
    model, deployment, pinned, version = resolve(session, tenant_id, body.model)
    if body.inputs is not None:
        instances, input_info = body.inputs.instances, None
    else:
        input_info = results.locate_input(settings, principal.tenant, body.input_uri or "")
        data = results.read_bytes(
            settings,
            input_info.uri,
            settings.jobs_max_input_bytes,
            input_info.etag,
            tenant=principal.tenant,
        )
        instances = results.parse_instances(data, "input_uri")
    check_instances(instances, version.input_schema)
    cost = CostModel.from_dict((version.cost_models or {}).get(hardware_key("cpu")))
    units = cost.cost(1) * len(instances)
    input_bytes = input_info.size if input_info else quotas.inline_bytes(instances)
    _check_quota(session, settings, principal, units, input_bytes)
    policy = PoolPolicy.model_validate(deployment.policy)
    job = Job(
        uid=records.new_uid(),
        tenant_id=tenant_id,
        model=model.name,
        version_ref=body.model.partition(":")[2] or None,
        version_pinned=pinned,
        deployment=deployment.name,
        priority=body.priority,
        instances=len(instances),
        units=units,
        chunk_size=max(1, min(settings.jobs_chunk_instances, policy.max_batch_size // 2)),
        inputs=instances if input_info is None else None,
        input_uri=input_info.uri if input_info else None,
        input_etag=input_info.etag if input_info else None,
        input_bytes=input_bytes,
        request_sha256=digest,
        idempotency_key=key,
        webhook_url=body.webhook_url,
        max_attempts=settings.jobs_max_attempts,
        # Optimistic: unset again below if publishing fails (then the sweeper publishes).
        published_at=records.utcnow(),
    )
    session.add(job)
    try:
        session.commit()
    except IntegrityError:  # the same key, submitted concurrently, won the race
        session.rollback()
        if key is not None and (found := _existing(session, tenant_id, key, digest)) is not None:
            return found, True
        raise
    with bound(job_id=job.uid, model=job.model):
        log.info(
            "job queued",
            instances=job.instances,
            units=round(units, 3),
            deployment=job.deployment,
            version=pinned,
        )
    attributes = tracing.model_attributes(job.model, pinned, job.deployment)
    tracing.annotate(attributes)  # the request's server span
    with tracing.span("enqueue", attributes | {"ember.job": job.uid}, SpanKind.PRODUCER):
        published = publisher.run(job.uid, job.priority)
    if not published:
        job.published_at = None
        session.add(job)
        session.commit()
    return job, False


def _check_quota(
    session: Session, settings: Settings, principal: Principal, units: float, input_bytes: int
) -> None:
    """The tenant's quotas (``ember.registry.quotas``: queued jobs, stored job bytes) and
    the model units its unfinished jobs may hold."""
    quotas.check_jobs(
        session, quotas.limits_for(session, settings, principal.tenant_id),
        principal.tenant_id, input_bytes,
    )  # fmt: skip
    queued_units = session.exec(
        select(func.coalesce(func.sum(Job.units), 0.0)).where(
            Job.tenant_id == principal.tenant_id, col(Job.status).in_(records.UNFINISHED)
        )
    ).one()
    if float(queued_units) + units > settings.jobs_tenant_max_queued_units:
        raise BackPressure(
            f"tenant {principal.tenant!r} has {float(queued_units):g} model units of unfinished "
            f"jobs; this one adds {units:g} and the quota is "
            f"{settings.jobs_tenant_max_queued_units:g}",
            retry_after_s=QUOTA_RETRY_AFTER_S,
            queued_units=round(float(queued_units), 3),
        )


def get_job(session: Session, tenant_id: int, uid: str) -> Job:
    job = session.exec(select(Job).where(Job.uid == uid, Job.tenant_id == tenant_id)).first()
    if job is None:
        raise NotFound(f"job {uid!r} does not exist")
    return job


def cancel(
    engine: Engine, session: Session, settings: Settings, publisher: Publisher, job: Job
) -> Job:
    if job.status not in records.UNFINISHED or not records.cancel(
        engine, job.id or 0, bool(job.webhook_url), settings.jobs_result_ttl_s
    ):
        session.rollback()  # end the read snapshot: see what finished the job
        session.refresh(job)
        raise Conflict(
            f"job {job.uid} is {job.status}; only queued or running jobs can be cancelled",
            job_status=job.status,
        )
    with bound(job_id=job.uid):
        log.info("job cancelled", was=job.status)
    if job.webhook_url:
        publisher.webhook(job.uid)
    session.rollback()  # end the read snapshot: the next read sees the cancel
    session.refresh(job)
    return job


def list_query(tenant_id: int, status: str | None, model: str | None) -> Any:
    query = select(Job).where(Job.tenant_id == tenant_id)
    if status is not None:
        query = query.where(Job.status == status)
    if model is not None:
        query = query.where(Job.model == model)
    return query


__all__ = ["JobStatus", "cancel", "get_job", "list_query", "resolve", "submit"]
