"""Every state change of a job, as a conditional UPDATE on the registry.

The job row is the source of truth; the lease, heartbeat and fence are
``ember.work.lease``'s (renewal is its ``Heartbeat``). A worker *claims* a job with
one UPDATE that only matches a queued job (or a running one whose lease ran out) and
sets a fresh lease token; every later write of that attempt is fenced with ``WHERE
lease = <token> AND status = 'running'``. A cancel, or another attempt that took the
job over, changes the token or the status, so the stale attempt's writes match no row:
a job's result is written exactly once, whatever the broker redelivers.

Each transaction writes before it reads, so SQLite (WAL) never has to upgrade a read
snapshot to a write lock (``database is locked``) and PostgreSQL holds the row lock.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, or_, update
from sqlalchemy.sql.dml import Update
from sqlmodel import Session, col, select

from ember.registry.tables import Job, JobAttempt, JobStatus
from ember.work import lease

TERMINAL = (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)
UNFINISHED = (JobStatus.queued, JobStatus.running)
EARLY_S = 1.0
"""A retry message may arrive this much before its ``not_before`` (clock skew)."""
LOST = (
    "the worker running this attempt stopped renewing its lease (killed, hung or cut off); "
    "the job was taken over"
)


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_uid() -> str:
    return "job_" + secrets.token_hex(12)


@contextmanager
def transaction(engine: Engine) -> Iterator[Session]:
    with Session(engine, expire_on_commit=False) as session, session.begin():
        yield session


def _rows(session: Session, stmt: Update) -> int:
    return int(session.connection().execute(stmt).rowcount)


def _close_attempt(
    session: Session,
    job_id: int,
    number: int | None,
    outcome: str,
    error: str | None = None,
    status_code: int | None = None,
    at: datetime | None = None,
) -> None:
    """Close the attempt ``number`` (every open one when None) if it is still open."""
    stmt = update(JobAttempt).where(
        col(JobAttempt.job_id) == job_id, col(JobAttempt.outcome) == "running"
    )
    if number is not None:
        stmt = stmt.where(col(JobAttempt.number) == number)
    values: dict[str, Any] = {"finished_at": at or utcnow(), "outcome": outcome}
    if error is not None:
        values["error"] = error[:2000]
    if status_code is not None:
        values["status_code"] = status_code
    _rows(session, stmt.values(**values))


def _terminal_values(job_has_webhook: bool, ttl_s: float, at: datetime) -> dict[str, Any]:
    values: dict[str, Any] = {
        "lease": None,
        "lease_expires_at": None,
        "not_before": None,
        "finished_at": at,
        "updated_at": at,
        "expires_at": at + timedelta(seconds=ttl_s),
    }
    if job_has_webhook:
        values |= {"webhook_status": "pending", "webhook_next_at": at}
    return values


def _fenced(job_id: int, token: str) -> Any:
    return lease.fence(Job, job_id, token)


# --- claim ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    job: Job
    lease: str
    number: int
    """This run's ``job_attempts.number``."""


@dataclass(frozen=True)
class Skip:
    """Why a delivered message did not start an attempt."""

    reason: str
    job: Job | None = None
    failed_now: bool = False
    """The job ran out of attempts just now (its last worker was lost): it is failed."""


def claim(engine: Engine, uid: str, worker: str, lease_s: float, ttl_s: float) -> Claim | Skip:
    """Take the job for one attempt: a queued job that is due, or a running one whose
    lease ran out (its worker is gone). Anything else is a duplicate delivery."""
    at = utcnow()
    token = lease.new_token()
    due = or_(col(Job.not_before).is_(None), col(Job.not_before) <= at + timedelta(seconds=EARLY_S))
    takeable = lease.takeable(Job, at, due)
    with transaction(engine) as session:
        taken = _rows(
            session,
            update(Job)
            .where(col(Job.uid) == uid, takeable, col(Job.attempt_count) < col(Job.max_attempts))
            .values(
                status=JobStatus.running,
                lease=token,
                lease_expires_at=lease.expiry(lease_s, at),
                attempt_count=col(Job.attempt_count) + 1,
                runs=col(Job.runs) + 1,
                started_at=func.coalesce(col(Job.started_at), at),
                updated_at=at,
                not_before=None,
            ),
        )
        if taken:
            job = session.exec(select(Job).where(col(Job.uid) == uid)).one()
            # A previous attempt still open lost its lease (its worker died or hung).
            _close_attempt(session, job.id or 0, None, "lost", LOST, at=at)
            session.add(
                JobAttempt(
                    job_id=job.id or 0, number=job.runs, lease=token, worker=worker, started_at=at
                )
            )
            return Claim(job, token, job.runs)
    return _why_not(engine, uid, at, ttl_s)


def _why_not(engine: Engine, uid: str, at: datetime, ttl_s: float) -> Skip:
    with transaction(engine) as session:
        exhausted = _rows(
            session,
            update(Job)
            .where(
                col(Job.uid) == uid,
                col(Job.status) == JobStatus.running,
                col(Job.lease_expires_at) < at,
                col(Job.attempt_count) >= col(Job.max_attempts),
            )
            .values(
                status=JobStatus.failed,
                error_code="attempts-exhausted",
                error="gave up: the worker running the last allowed attempt was lost",
                **_terminal_values(False, ttl_s, at),
            ),
        )
        job = session.exec(select(Job).where(col(Job.uid) == uid)).first()
        if job is None:
            return Skip("no such job")
        if exhausted:
            _close_attempt(session, job.id or 0, None, "lost", LOST, at=at)
            if job.webhook_url:
                job.webhook_status, job.webhook_next_at = "pending", at
                session.add(job)
            return Skip("attempts exhausted", job, failed_now=True)
        if job.status in TERMINAL:
            return Skip(f"already {job.status}", job)
        if job.status == JobStatus.running:
            return Skip("running under a live lease", job)
        return Skip("not due yet", job)


# --- while running -------------------------------------------------------------------


def set_version(engine: Engine, job_id: int, token: str, version: str) -> bool:
    with transaction(engine) as session:
        return bool(
            _rows(session, update(Job).where(_fenced(job_id, token)).values(version=version))
        )


# --- outcomes (all fenced on the lease) ----------------------------------------------


def succeed(
    engine: Engine,
    claim: Claim,
    *,
    version: str,
    rung: str | None,
    result: list[Any] | None,
    result_uri: str | None,
    result_sha256: str,
    result_bytes: int,
    ttl_s: float,
) -> bool:
    """Write the result, exactly once: False if the lease is no longer ours."""
    at = utcnow()
    job = claim.job
    with transaction(engine) as session:
        written = _rows(
            session,
            update(Job)
            .where(_fenced(job.id or 0, claim.lease))
            .values(
                status=JobStatus.succeeded,
                version=version,
                rung=rung,
                result=result,
                result_uri=result_uri,
                result_sha256=result_sha256,
                result_bytes=result_bytes,
                error=None,
                error_code=None,
                **_terminal_values(bool(job.webhook_url), ttl_s, at),
            ),
        )
        _close_attempt(
            session,
            job.id or 0,
            claim.number,
            "succeeded" if written else "superseded",
            None if written else "result discarded: the job was cancelled or taken over",
            at=at,
        )
        return bool(written)


def fail(
    engine: Engine,
    claim: Claim,
    *,
    error: str,
    code: str,
    status_code: int | None,
    ttl_s: float,
    version: str | None = None,
) -> bool:
    at = utcnow()
    job = claim.job
    with transaction(engine) as session:
        values = _terminal_values(bool(job.webhook_url), ttl_s, at)
        if version is not None:
            values["version"] = version
        written = _rows(
            session,
            update(Job)
            .where(_fenced(job.id or 0, claim.lease))
            .values(status=JobStatus.failed, error=error[:2000], error_code=code, **values),
        )
        _close_attempt(
            session,
            job.id or 0,
            claim.number,
            "failed" if written else "superseded",
            error,
            status_code,
            at,
        )
        return bool(written)


def release(
    engine: Engine,
    claim: Claim,
    *,
    error: str,
    status_code: int | None,
    delay_s: float,
    deferral: bool,
) -> bool:
    """Back to ``queued`` until ``now + delay_s``: a transient failure (it counted as an
    attempt) or a deferral (shed with 429; it does not count)."""
    at = utcnow()
    job = claim.job
    values: dict[str, Any] = {
        "status": JobStatus.queued,
        "lease": None,
        "lease_expires_at": None,
        "not_before": at + timedelta(seconds=delay_s),
        "published_at": at,
        "updated_at": at,
    }
    if deferral:
        values["attempt_count"] = col(Job.attempt_count) - 1
        values["deferrals"] = col(Job.deferrals) + 1
    with transaction(engine) as session:
        written = _rows(
            session, update(Job).where(_fenced(job.id or 0, claim.lease)).values(**values)
        )
        outcome = ("deferred" if deferral else "failed") if written else "superseded"
        _close_attempt(session, job.id or 0, claim.number, outcome, error, status_code, at)
        return bool(written)


def abandon(engine: Engine, claim: Claim, reason: str) -> None:
    """The lease was lost mid-run: close this attempt (its result, if any, is dropped)."""
    with transaction(engine) as session:
        _close_attempt(session, claim.job.id or 0, claim.number, "superseded", reason)


# --- API side ------------------------------------------------------------------------


def cancel(engine: Engine, job_id: int, has_webhook: bool, ttl_s: float) -> bool:
    """Cancel a queued or running job; False if it already finished."""
    at = utcnow()
    with transaction(engine) as session:
        written = _rows(
            session,
            update(Job)
            .where(col(Job.id) == job_id, col(Job.status).in_(UNFINISHED))
            .values(
                status=JobStatus.cancelled,
                error="cancelled by the client",
                error_code="cancelled",
                **_terminal_values(has_webhook, ttl_s, at),
            ),
        )
        if written:
            _close_attempt(session, job_id, None, "cancelled", "cancelled by the client", at=at)
        return bool(written)


def unpublish(engine: Engine, job_id: int) -> None:
    """Its message could not be published: the sweeper publishes it when it is due."""
    with transaction(engine) as session:
        _rows(session, update(Job).where(col(Job.id) == job_id).values(published_at=None))


def mark_published(engine: Engine, job_ids: list[int]) -> None:
    if not job_ids:
        return
    at = utcnow()
    with transaction(engine) as session:
        _rows(session, update(Job).where(col(Job.id).in_(job_ids)).values(published_at=at))
