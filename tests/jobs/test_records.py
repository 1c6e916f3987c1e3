"""The fence, on the real registry (SQLite and PostgreSQL): whatever the broker delivers
and whoever was presumed dead, a job's result is written exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from ember.jobs import records
from ember.registry.db import session_scope
from ember.registry.tables import Job, JobAttempt
from ember.work import lease
from tests import services

TTL = 3600.0


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Engine:
    postgres = request.getfixturevalue("postgres_url") if request.param == "postgres" else ""
    engine: Engine = services.migrated_registry(
        request.param, tmp_path, postgres, "ek_records-test-admin-key-000"
    )
    return engine


def new_job(engine: Engine, **fields: object) -> str:
    with session_scope(engine) as session:
        job = Job(
            uid=records.new_uid(),
            tenant_id=1,
            model="m",
            deployment="m",
            request_sha256="0" * 64,
            inputs=[[1.0]],
            instances=1,
            **fields,
        )  # type: ignore[arg-type]
        session.add(job)
    return job.uid


def row(engine: Engine, uid: str) -> tuple[Job, list[JobAttempt]]:
    with Session(engine) as session:
        job = session.exec(select(Job).where(Job.uid == uid)).one()
        attempts = session.exec(
            select(JobAttempt).where(JobAttempt.job_id == job.id).order_by(col(JobAttempt.number))
        ).all()
        return job, list(attempts)


def succeed(engine: Engine, claim: records.Claim, value: float) -> bool:
    return records.succeed(
        engine,
        claim,
        version="1",
        rung="model",
        result=[[value]],
        result_uri=None,
        result_sha256="f" * 64,
        result_bytes=10,
        ttl_s=TTL,
    )


def test_a_presumed_dead_attempt_cannot_write_a_second_result(engine: Engine) -> None:
    uid = new_job(engine)
    first = records.claim(engine, uid, "a:1", lease_s=-1, ttl_s=TTL)  # its lease already ran out
    assert isinstance(first, records.Claim) and first.number == 1
    second = records.claim(engine, uid, "b:2", lease_s=30, ttl_s=TTL)  # takes the job over
    assert isinstance(second, records.Claim) and second.number == 2
    third = records.claim(engine, uid, "c:3", lease_s=30, ttl_s=TTL)
    assert isinstance(third, records.Skip) and "live lease" in third.reason

    assert not lease.renew(engine, Job, first.job.id or 0, first.lease, 30)
    assert succeed(engine, second, 2.0)
    assert not succeed(engine, first, 1.0)  # the zombie's write matches no row
    assert not succeed(engine, second, 3.0)  # and nothing is written twice
    job, attempts = row(engine, uid)
    assert job.status == "succeeded" and job.result == [[2.0]] and job.lease is None
    assert [(a.worker, a.outcome) for a in attempts] == [("a:1", "lost"), ("b:2", "succeeded")]
    redelivered = records.claim(engine, uid, "d:4", lease_s=30, ttl_s=TTL)
    assert isinstance(redelivered, records.Skip) and redelivered.reason == "already succeeded"


def test_attempts_are_bounded_and_deferrals_are_not_attempts(engine: Engine) -> None:
    uid = new_job(engine, max_attempts=2)
    claim = records.claim(engine, uid, "a:1", lease_s=30, ttl_s=TTL)
    assert isinstance(claim, records.Claim)
    assert records.release(engine, claim, error="shed", status_code=429, delay_s=0, deferral=True)
    job, _ = row(engine, uid)
    assert (job.status, job.attempt_count, job.deferrals) == ("queued", 0, 1)

    claim = records.claim(engine, uid, "a:1", lease_s=30, ttl_s=TTL)
    assert isinstance(claim, records.Claim)
    assert records.release(
        engine, claim, error="503", status_code=503, delay_s=3600, deferral=False
    )
    early = records.claim(engine, uid, "a:1", lease_s=30, ttl_s=TTL)
    assert isinstance(early, records.Skip) and early.reason == "not due yet"
    with session_scope(engine) as session:
        job = session.exec(select(Job).where(Job.uid == uid)).one()
        job.not_before = None
        session.add(job)
    last = records.claim(engine, uid, "a:1", lease_s=-1, ttl_s=TTL)  # the 2nd attempt; lost
    assert isinstance(last, records.Claim)
    gone = records.claim(engine, uid, "b:2", lease_s=30, ttl_s=TTL)
    assert isinstance(gone, records.Skip) and gone.failed_now
    job, attempts = row(engine, uid)
    assert job.status == "failed" and job.error_code == "attempts-exhausted"
    assert [a.outcome for a in attempts] == ["deferred", "failed", "lost"]


def test_cancel_fences_out_the_running_attempt(engine: Engine) -> None:
    uid = new_job(engine)
    claim = records.claim(engine, uid, "a:1", lease_s=30, ttl_s=TTL)
    assert isinstance(claim, records.Claim)
    assert records.cancel(engine, claim.job.id or 0, has_webhook=False, ttl_s=TTL)
    assert not records.cancel(engine, claim.job.id or 0, has_webhook=False, ttl_s=TTL)
    assert not lease.renew(engine, Job, claim.job.id or 0, claim.lease, 30)
    assert not succeed(engine, claim, 1.0)
    assert not records.release(engine, claim, error="x", status_code=503, delay_s=0, deferral=False)
    job, attempts = row(engine, uid)
    assert job.status == "cancelled" and job.result is None
    assert [a.outcome for a in attempts] == ["cancelled"]
