"""The async regime: submit a job, poll it (or get a webhook), fetch its result."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request, Response, status
from fastapi.responses import StreamingResponse

from ember.api.deps import Cursor, Limit, PrincipalDep, SessionDep, SettingsDep
from ember.errors import Conflict, NotFound, ObjectNotFound
from ember.jobs import results, submit, webhooks
from ember.jobs.queue import Publisher
from ember.jobs.schemas import (
    JOB_ID_PATTERN,
    JobCreate,
    JobPublic,
    JobState,
    JobSummary,
    WebhookSecretPublic,
    job_public,
    job_summary,
)
from ember.loader.stores import open_store
from ember.registry.pagination import paginate
from ember.registry.schemas import NAME_PATTERN, Page
from ember.registry.tables import Job, JobStatus
from ember.web.problems import problem_responses

router = APIRouter(tags=["jobs"])
JobId = Annotated[str, Path(pattern=JOB_ID_PATTERN, description="A job id (`job_...`).")]
SCHEME = 'HMAC-SHA256(secret, "<t>." + raw body), hex; header `t=<unix seconds>,v1=<hex>`'


def _publisher(request: Request) -> Publisher:
    publisher: Publisher | None = getattr(request.app.state, "job_publisher", None)
    if publisher is None:  # an app without the lifespan (tests building routes alone)
        publisher = request.app.state.job_publisher = Publisher(request.app.state.settings)
    return publisher


@router.post(
    "/v1/jobs",
    status_code=status.HTTP_202_ACCEPTED,
    summary="Submit a job",
    responses=problem_responses(
        (403, "Over the tenant's quota of stored job bytes"),
        (429, "Over the tenant's quota of unfinished jobs"),
    ),
)
def submit_job(
    body: JobCreate,
    request: Request,
    response: Response,
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            max_length=255,
            description="The same key with the same body returns the same job; with a "
            "different body, 409.",
        ),
    ] = None,
) -> JobPublic:
    """Queued for the async class of the deployment serving `model`; `202` with the job.
    Poll `GET /v1/jobs/{id}`, or pass `webhook_url`."""
    job, replayed = submit.submit(
        session, settings, _publisher(request), principal, body, idempotency_key
    )
    response.headers["Location"] = f"/v1/jobs/{job.uid}"
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return job_public(session, job)


@router.get("/v1/jobs", summary="List jobs")
def list_jobs(
    principal: PrincipalDep,
    session: SessionDep,
    limit: Limit = 50,
    cursor: Cursor = None,
    status: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
    model: Annotated[
        str | None, Query(pattern=NAME_PATTERN, description="Only jobs of this model.")
    ] = None,
) -> Page[JobSummary]:
    """Your tenant's jobs, oldest first."""
    query = submit.list_query(principal.tenant_id, status, model)
    rows, next_cursor = paginate(session, query, Job.id, limit, cursor)
    return Page(items=[job_summary(j) for j in rows], next_cursor=next_cursor)


@router.get("/v1/jobs/{job_id}", summary="Get a job")
def get_job(job_id: JobId, principal: PrincipalDep, session: SessionDep) -> JobPublic:
    """Status, timestamps, every attempt with its error, the version that ran it, and the
    result inline (small) or its URI and sha256 (large: fetch it from `/result`)."""
    return job_public(session, submit.get_job(session, principal.tenant_id, job_id))


@router.get(
    "/v1/jobs/{job_id}/result",
    summary="A succeeded job's result",
    response_class=Response,
    responses={200: {"content": {"application/json": {}}, "description": "The result JSON"}},
)
def get_result(
    job_id: JobId, principal: PrincipalDep, session: SessionDep, settings: SettingsDep
) -> Response:
    """`{"predictions": [...]}`, inline or streamed from the object store; its sha256 is in
    `X-Ember-Result-Sha256`."""
    job = submit.get_job(session, principal.tenant_id, job_id)
    if job.status != JobStatus.succeeded:
        raise Conflict(
            f"job {job.uid} is {job.status}; only a succeeded job has a result",
            job_status=job.status,
        )
    if job.purged_at is not None:
        raise NotFound(f"the result of job {job.uid} was purged (EMBER_JOBS_RESULT_TTL_S)")
    headers = {"X-Ember-Result-Sha256": job.result_sha256 or ""}
    if job.result is not None:
        return Response(
            results.encode_result(job.result), media_type="application/json", headers=headers
        )
    uri = job.result_uri or ""
    store = open_store(uri, settings)
    try:
        info = store.stat(uri)
    except ObjectNotFound as exc:
        raise NotFound(f"the result object of job {job.uid} is gone: {exc.detail}") from exc
    headers["Content-Length"] = str(info.size)
    return StreamingResponse(
        store.iter_chunks(uri, etag=info.etag), media_type="application/json", headers=headers
    )


@router.delete("/v1/jobs/{job_id}", summary="Cancel a job")
def cancel_job(
    job_id: JobId,
    request: Request,
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
) -> JobPublic:
    """Cancels a queued or running job (`409` once it finished). A running attempt stops
    at its next chunk; whatever it computes is discarded."""
    job = submit.get_job(session, principal.tenant_id, job_id)
    engine = request.app.state.engine
    job = submit.cancel(engine, session, settings, _publisher(request), job)
    return job_public(session, job)


@router.get("/v1/webhooks/secret", summary="Your webhook signing secret")
def webhook_secret(principal: PrincipalDep, session: SessionDep) -> WebhookSecretPublic:
    """Created on first use. Job webhooks carry `Ember-Signature: t=...,v1=...`."""
    row = webhooks.tenant_secret(session, principal.tenant_id)
    session.commit()
    return WebhookSecretPublic(
        secret=row.secret,
        created_at=row.created_at,
        header=webhooks.SIGNATURE_HEADER,
        scheme=SCHEME,
    )


@router.post("/v1/webhooks/secret:rotate", summary="Replace your webhook signing secret")
def rotate_webhook_secret(principal: PrincipalDep, session: SessionDep) -> WebhookSecretPublic:
    row = webhooks.tenant_secret(session, principal.tenant_id, rotate=True)
    session.commit()
    return WebhookSecretPublic(
        secret=row.secret,
        created_at=row.created_at,
        header=webhooks.SIGNATURE_HEADER,
        scheme=SCHEME,
    )
