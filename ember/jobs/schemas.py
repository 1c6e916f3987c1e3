"""Wire schemas of the jobs API and the public document of a job."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlmodel import Session, col, select

from ember.registry.tables import Job, JobAttempt

MODEL_REF_PATTERN = (
    r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?"
    r"(:[A-Za-z0-9]([A-Za-z0-9._+-]{0,61}[A-Za-z0-9])?)?$"
)
JOB_ID_PATTERN = r"^job_[0-9a-f]{24}$"
JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class JobInputs(BaseModel):
    """The same body as ``:predict``."""

    model_config = ConfigDict(extra="forbid")

    instances: list[Any] = Field(min_length=1, max_length=1_000_000)


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        pattern=MODEL_REF_PATTERN,
        max_length=127,
        description="`name`, or `name:version`, or `name:alias` (`production`, `canary`). "
        "Without a version the deployment's traffic split picks one; every chunk of the job "
        "then runs on that version.",
        examples=["mlp", "mlp:2", "mlp:production"],
    )
    inputs: JobInputs | None = Field(None, description='`{"instances": [...]}`, as `:predict`.')
    input_uri: str | None = Field(
        None,
        min_length=1,
        max_length=2048,
        description='For large inputs: an object holding `{"instances": [...]}` under the '
        "object store's `job-inputs/<tenant>/` prefix.",
    )
    priority: int = Field(5, ge=0, le=9, description="Within the async class; higher first.")
    webhook_url: str | None = Field(
        None,
        min_length=1,
        max_length=2048,
        description="POSTed the job's document (signed) when it finishes.",
    )

    @model_validator(mode="after")
    def _one_input(self) -> JobCreate:
        if (self.inputs is None) == (self.input_uri is None):
            raise ValueError("give exactly one of `inputs` and `input_uri`")
        return self


class AttemptPublic(BaseModel):
    number: int
    outcome: str = Field(
        description="running | succeeded | failed | deferred (shed with 429; not counted) | "
        "lost (its worker died) | cancelled | superseded (its result was discarded)"
    )
    worker: str
    started_at: datetime
    finished_at: datetime | None
    status_code: int | None
    error: str | None


class WebhookPublic(BaseModel):
    url: str
    status: str | None = Field(description="pending | delivered | failed | refused")
    attempts: int
    error: str | None
    delivered_at: datetime | None


class JobSummary(BaseModel):
    id: str
    model: str
    version_ref: str | None = Field(description="What was asked for (a version or an alias).")
    deployment: str
    version: str | None = Field(description="The version that ran it.")
    status: JobState
    priority: int
    instances: int
    units: float = Field(description="Estimated model units.")
    attempt_count: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    error_code: str | None


class JobPublic(JobSummary):
    max_attempts: int
    deferrals: int
    next_attempt_at: datetime | None = Field(description="When a retry is due (queued).")
    updated_at: datetime
    rung: str | None = Field(description="Degradation-ladder rung that answered.")
    input_uri: str | None
    idempotency_key: str | None
    attempts: list[AttemptPublic]
    result: dict[str, Any] | None = Field(
        description='`{"predictions": [...]}` when small enough to keep inline.'
    )
    result_uri: str | None = Field(description="Where a large result is (see `/result`).")
    result_sha256: str | None = Field(
        description='sha256 of the canonical result JSON `{"predictions":[...]}`.'
    )
    result_bytes: int | None
    result_expires_at: datetime | None
    result_purged: bool
    webhook: WebhookPublic | None


class WebhookSecretPublic(BaseModel):
    secret: str
    created_at: datetime
    header: str = Field(description="The header that carries the signature.")
    scheme: str = Field(description="How the signature is computed.")


def job_summary(job: Job) -> JobSummary:
    return JobSummary(**_summary_fields(job))


def _summary_fields(job: Job) -> dict[str, Any]:
    return {
        "id": job.uid,
        "model": job.model,
        "version_ref": job.version_ref,
        "deployment": job.deployment,
        "version": job.version,
        "status": job.status,
        "priority": job.priority,
        "instances": job.instances,
        "units": job.units,
        "attempt_count": job.attempt_count,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "error": job.error,
        "error_code": job.error_code,
    }


def job_public(session: Session, job: Job) -> JobPublic:
    attempts = session.exec(
        select(JobAttempt).where(JobAttempt.job_id == job.id).order_by(col(JobAttempt.number))
    ).all()
    webhook = None
    if job.webhook_url:
        webhook = WebhookPublic(
            url=job.webhook_url,
            status=job.webhook_status,
            attempts=job.webhook_attempts,
            error=job.webhook_error,
            delivered_at=job.webhook_delivered_at,
        )
    return JobPublic(
        **_summary_fields(job),
        max_attempts=job.max_attempts,
        deferrals=job.deferrals,
        next_attempt_at=job.not_before if job.status == "queued" else None,
        updated_at=job.updated_at,
        rung=job.rung,
        input_uri=job.input_uri,
        idempotency_key=job.idempotency_key,
        attempts=[
            AttemptPublic(
                number=a.number,
                outcome=a.outcome,
                worker=a.worker,
                started_at=a.started_at,
                finished_at=a.finished_at,
                status_code=a.status_code,
                error=a.error,
            )
            for a in attempts
        ],
        result={"predictions": job.result} if job.result is not None else None,
        result_uri=job.result_uri,
        result_sha256=job.result_sha256,
        result_bytes=job.result_bytes,
        result_expires_at=job.expires_at if job.status == "succeeded" else None,
        result_purged=job.purged_at is not None,
        webhook=webhook,
    )


def job_document(session: Session, job: Job) -> dict[str, Any]:
    """What a webhook delivers: the job's public document."""
    return job_public(session, job).model_dump(mode="json")
