"""``ember.work.lease`` on a real registry (SQLite, and PostgreSQL where the suite runs
it): claim, heartbeat, a stale fencing token refused, expiry and takeover."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, update
from sqlmodel import Session, col

from ember.jobs import records
from ember.registry.db import make_engine, session_scope
from ember.registry.tables import Job
from ember.work import lease
from tests import services


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Engine:
    postgres = request.getfixturevalue("postgres_url") if request.param == "postgres" else ""
    engine: Engine = services.migrated_registry(
        request.param, tmp_path, postgres, "ek_lease-test-admin-key-0000"
    )
    return engine


def new_row(engine: Engine) -> int:
    with session_scope(engine) as session:
        job = Job(
            uid=records.new_uid(),
            tenant_id=1,
            model="m",
            deployment="m",
            request_sha256="0" * 64,
            inputs=[[1.0]],
            instances=1,
        )
        session.add(job)
        session.flush()
        return job.id or 0


def claim(engine: Engine, row_id: int, lease_s: float, at: datetime | None = None) -> str | None:
    """What a caller's claim does with the module: one conditional UPDATE."""
    at = at or lease.utcnow()
    token = lease.new_token()
    with Session(engine) as session, session.begin():
        taken = session.connection().execute(
            update(Job)
            .where(col(Job.id) == row_id, lease.takeable(Job, at))
            .values(status=lease.RUNNING, lease=token, lease_expires_at=lease.expiry(lease_s, at))
        )
        return token if taken.rowcount == 1 else None


def fenced_commit(engine: Engine, row_id: int, token: str) -> bool:
    with Session(engine) as session, session.begin():
        written = session.connection().execute(
            update(Job)
            .where(lease.fence(Job, row_id, token))
            .values(status="succeeded", lease=None, lease_expires_at=None)
        )
        return bool(written.rowcount)


def expires_at(engine: Engine, row_id: int) -> datetime:
    with Session(engine) as session:
        job = session.get(Job, row_id)
        assert job is not None and job.lease_expires_at is not None
        return job.lease_expires_at


def expire(engine: Engine, row_id: int) -> None:
    with Session(engine) as session, session.begin():
        session.connection().execute(
            update(Job)
            .where(col(Job.id) == row_id)
            .values(lease_expires_at=lease.utcnow() - timedelta(seconds=1))
        )


def test_a_queued_row_is_claimed_once(engine: Engine) -> None:
    row_id = new_row(engine)
    token = claim(engine, row_id, 30)
    assert token is not None and len(token) == 32
    assert claim(engine, row_id, 30) is None  # a duplicate delivery: running, live lease
    assert fenced_commit(engine, row_id, token)
    assert claim(engine, row_id, 30) is None  # finished: nothing to take


def test_renew_extends_only_the_holders_lease(engine: Engine) -> None:
    row_id = new_row(engine)
    token = claim(engine, row_id, 5)
    assert token is not None
    before = expires_at(engine, row_id)
    time.sleep(0.01)
    assert lease.renew(engine, Job, row_id, token, 60)
    assert expires_at(engine, row_id) > before
    assert not lease.renew(engine, Job, row_id, lease.new_token(), 60)


def test_an_expired_lease_is_taken_over_and_the_stale_fence_refused(engine: Engine) -> None:
    row_id = new_row(engine)
    stale = claim(engine, row_id, 30)
    assert stale is not None
    expire(engine, row_id)  # its worker stopped renewing (killed, hung)
    fresh = claim(engine, row_id, 30)
    assert fresh is not None and fresh != stale
    assert not lease.renew(engine, Job, row_id, stale, 30)
    assert not fenced_commit(engine, row_id, stale)  # the presumed-dead worker writes nothing
    assert fenced_commit(engine, row_id, fresh)
    assert not fenced_commit(engine, row_id, fresh)  # exactly once


def test_a_live_lease_is_not_takeable_until_it_expires(engine: Engine) -> None:
    row_id = new_row(engine)
    assert claim(engine, row_id, 30) is not None
    assert claim(engine, row_id, 30, at=lease.utcnow() + timedelta(seconds=29)) is None
    assert claim(engine, row_id, 30, at=lease.utcnow() + timedelta(seconds=31)) is not None


def test_heartbeat_renews_and_marks_a_taken_over_lease_lost(engine: Engine) -> None:
    row_id = new_row(engine)
    token = claim(engine, row_id, 5)
    assert token is not None
    heartbeat = lease.Heartbeat(engine, Job, 60, "test-heartbeat")
    held = lease.Lease(row_id, token)
    heartbeat.held[row_id] = held  # no thread: beats by hand
    before = expires_at(engine, row_id)
    heartbeat.beat()
    assert expires_at(engine, row_id) > before and not held.lost.is_set()
    expire(engine, row_id)
    assert claim(engine, row_id, 30) is not None  # another worker took it over
    heartbeat.beat()
    assert held.lost.is_set()
    assert row_id not in heartbeat.held  # a lost lease is no longer renewed


def test_heartbeat_thread_renews_until_released(engine: Engine) -> None:
    row_id = new_row(engine)
    token = claim(engine, row_id, 0.6)
    assert token is not None
    heartbeat = lease.Heartbeat(engine, Job, 0.6, "test-heartbeat")
    held = heartbeat.hold(row_id, token)  # starts the thread
    try:
        time.sleep(1.5)  # past the first lease: renewed every 0.2 s
        assert claim(engine, row_id, 30) is None
        assert not held.lost.is_set()
        heartbeat.release(row_id)
        time.sleep(1.0)
        assert claim(engine, row_id, 30) is not None  # released: it expired
    finally:
        heartbeat.stop.set()
        heartbeat.thread.join(2)


def test_heartbeat_survives_an_unreachable_registry(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'missing' / 'r.db'}")
    heartbeat = lease.Heartbeat(engine, Job, 30, "test-heartbeat")
    held = heartbeat.hold(1, lease.new_token())
    heartbeat.stop.set()
    heartbeat.beat()  # logged, not raised; tried again next beat
    assert not held.lost.is_set() and 1 in heartbeat.held
