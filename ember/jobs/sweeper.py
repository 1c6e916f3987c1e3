"""The sweeper: no job vanishes because a message did.

Every worker runs one; a Redis lock lets one of them work per interval. Each sweep:

1. **Broker data loss.** ``ember:jobs:epoch`` is written by the sweeper; when Redis comes
   back without it (restart without persistence, failover, flush), every queued job and
   pending webhook is marked unpublished.
2. **Publish** queued jobs that are due and were never published (a submission while
   Redis was down, a lost epoch), whose message is long overdue
   (``EMBER_JOBS_REPUBLISH_AFTER_S``, a safety net), and running jobs whose **lease ran
   out** (their worker was killed or hung): another attempt takes them over. Duplicate
   messages are harmless — the claim refuses them.
3. Re-publish **webhooks** whose delivery is overdue.
4. **Purge** finished jobs past ``EMBER_JOBS_RESULT_TTL_S``: their result objects and
   their inline inputs and results; the job's record stays (``result_purged``).
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, and_, or_, update
from sqlmodel import col, select

from ember.config import Settings
from ember.jobs import records, results
from ember.jobs.queue import EPOCH_KEY, SWEEP_LOCK, Publisher
from ember.logs import get_logger
from ember.registry.tables import Job, JobStatus, Tenant
from ember.work.queue import broker_url

log = get_logger(__name__)
BATCH = 500
FRESH_S = 2.0
"""A job younger than this without ``published_at`` is still being published by the API."""


@dataclass
class SweepReport:
    epoch_lost: bool = False
    published: list[str] = field(default_factory=list)
    webhooks: list[str] = field(default_factory=list)
    purged: list[str] = field(default_factory=list)


class Sweeper:
    def __init__(self, settings: Settings, engine: Engine, publisher: Publisher) -> None:
        import redis

        self.settings = settings
        self.engine = engine
        self.publisher = publisher
        self.redis = redis.Redis.from_url(
            broker_url(settings), socket_connect_timeout=4, socket_timeout=10
        )
        self.token = secrets.token_hex(8)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="ember-sweeper", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.sweep()
            except Exception as exc:  # Redis or the registry down: try again next time
                log.warning("sweep failed", error=f"{type(exc).__name__}: {exc}"[:300])
            self.stop.wait(self.settings.jobs_sweep_interval_s)

    def sweep(self, now: datetime | None = None, *, force: bool = False) -> SweepReport:
        report = SweepReport()
        interval_ms = int(self.settings.jobs_sweep_interval_s * 1000)
        if not force and not self.redis.set(SWEEP_LOCK, self.token, nx=True, px=interval_ms):
            return report  # another worker's sweeper has this interval
        at = now or records.utcnow()
        if self.redis.get(EPOCH_KEY) is None:
            report.epoch_lost = True
            self._forget_publications()
            self.redis.set(EPOCH_KEY, self.token)
        report.published = self._publish_lost(at)
        report.webhooks = self._republish_webhooks(at, report.epoch_lost)
        report.purged = self.purge(at)
        if report.epoch_lost or report.published or report.webhooks or report.purged:
            log.info(
                "sweep",
                epoch_lost=report.epoch_lost,
                published=len(report.published),
                webhooks=len(report.webhooks),
                purged=len(report.purged),
            )
        return report

    def _forget_publications(self) -> None:
        with records.transaction(self.engine) as session:
            session.connection().execute(
                update(Job).where(col(Job.status) == JobStatus.queued).values(published_at=None)
            )

    def _publish_lost(self, at: datetime) -> list[str]:
        s = self.settings
        overdue = at - timedelta(seconds=s.jobs_republish_after_s)
        due = or_(col(Job.not_before).is_(None), col(Job.not_before) <= at)
        lost_message = and_(
            col(Job.status) == JobStatus.queued,
            due,
            or_(
                and_(
                    col(Job.published_at).is_(None),
                    col(Job.created_at) < at - timedelta(seconds=FRESH_S),
                ),
                and_(
                    col(Job.published_at) < overdue,
                    or_(col(Job.not_before).is_(None), col(Job.not_before) < overdue),
                ),
            ),
        )
        lease_expired = and_(
            col(Job.status) == JobStatus.running,
            col(Job.lease_expires_at) < at,
            or_(
                col(Job.published_at).is_(None),
                col(Job.published_at) < at - timedelta(seconds=s.jobs_lease_s),
            ),
        )
        with records.transaction(self.engine) as session:
            rows = session.exec(
                select(Job.id, Job.uid, Job.priority)
                .where(or_(lost_message, lease_expired))
                .order_by(col(Job.priority).desc(), col(Job.id))
                .limit(BATCH)
            ).all()
        sent = [(i, uid) for i, uid, priority in rows if self.publisher.run(uid, priority)]
        records.mark_published(self.engine, [i or 0 for i, _ in sent])
        return [uid for _, uid in sent]

    def _republish_webhooks(self, at: datetime, everything: bool) -> list[str]:
        overdue = at - timedelta(seconds=self.settings.jobs_republish_after_s)
        query = select(Job.uid).where(col(Job.webhook_status) == "pending")
        if not everything:
            query = query.where(col(Job.webhook_next_at) < overdue)
        with records.transaction(self.engine) as session:
            uids = session.exec(query.limit(BATCH)).all()
        if everything:  # their delivery claims may be held by messages that are gone
            with records.transaction(self.engine) as session:
                session.connection().execute(
                    update(Job).where(col(Job.uid).in_(uids)).values(webhook_next_at=at)
                )
        return [uid for uid in uids if self.publisher.webhook(uid)]

    def purge(self, at: datetime) -> list[str]:
        """Drop results and inputs of jobs finished more than the TTL ago."""
        with records.transaction(self.engine) as session:
            rows = session.exec(
                select(Job, Tenant.name)
                .join(Tenant, col(Tenant.id) == col(Job.tenant_id))
                .where(col(Job.expires_at) < at, col(Job.purged_at).is_(None))
                .limit(BATCH)
            ).all()
        purged: list[str] = []
        for job, tenant in rows:
            try:
                if job.version:
                    prefix = results.result_prefix(
                        self.settings, tenant, job.model, job.version, job.uid
                    )
                    results.delete_prefix(self.settings, prefix)
            except Exception as exc:
                log.warning("result purge failed", job_id=job.uid, error=str(exc)[:300])
                continue
            values: dict[str, Any] = {"result": None, "inputs": None, "purged_at": at}
            with records.transaction(self.engine) as session:
                session.connection().execute(
                    update(Job).where(col(Job.id) == job.id).values(**values)
                )
            purged.append(job.uid)
        return purged
