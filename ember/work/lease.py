"""Leases on registry rows: claim, heartbeat, fenced commit.

A unit of work (a job, a batch shard) is a registry row with a ``status``, a ``lease``
token and a ``lease_expires_at``. The vocabulary is Celery's and Temporal's:

- **claim**: one conditional UPDATE takes a row that is ``queued`` (and due), or
  ``running`` under a lease that expired (its worker died or hung), and sets a fresh
  token: the *fencing token*. Two workers handed the same message cannot both claim it.
- **heartbeat**: while the work runs, one thread per process extends the leases it
  holds every third of the lease; a renewal that matches no row means the lease is
  someone else's now (cancelled, or taken over after a stall): the ``Lease`` is marked
  lost and the work stops.
- **fenced commit**: every write of an attempt is ``WHERE id = … AND lease = <token>
  AND status = 'running'`` (``fence``); a stale attempt's writes match no row, so a
  result is written once whatever the broker redelivers.

The claim's own UPDATE differs per table (a job counts attempts and keeps an attempt
log, a shard only counts), so the callers build it from ``takeable``, ``new_token`` and
``expiry``; the predicates and the heartbeat are the same for both.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, and_, or_, update
from sqlmodel import Session, col

from ember.logs import get_logger
from ember.registry.tables import BatchShard, Job

log = get_logger(__name__)

Leased = type[Job] | type[BatchShard]
"""The tables whose rows are leased."""
RUNNING = "running"
QUEUED = "queued"


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_token() -> str:
    """A fresh fencing token."""
    return secrets.token_hex(16)


def expiry(lease_s: float, at: datetime | None = None) -> datetime:
    return (at or utcnow()) + timedelta(seconds=lease_s)


def takeable(table: Leased, at: datetime, due: Any = None) -> Any:
    """What a claim may take: a queued row (that is ``due``, when given), or a running one
    whose lease expired before ``at``."""
    queued = col(table.status) == QUEUED
    return or_(
        queued if due is None else and_(queued, due),
        and_(col(table.status) == RUNNING, col(table.lease_expires_at) < at),
    )


def fence(table: Leased, row_id: int, token: str) -> Any:
    """The fenced-write predicate: the row, still running under this token."""
    return and_(col(table.id) == row_id, col(table.lease) == token, col(table.status) == RUNNING)


def renew(engine: Engine, table: Leased, row_id: int, token: str, lease_s: float) -> bool:
    """Extend the lease; False when it is no longer ours (cancelled or taken over)."""
    with Session(engine) as session, session.begin():
        result = session.connection().execute(
            update(table)
            .where(fence(table, row_id, token))
            .values(lease_expires_at=expiry(lease_s))
        )
        return bool(result.rowcount)


@dataclass
class Lease:
    """A lease this process holds: the row, its fencing token, and whether it was lost."""

    row_id: int
    token: str
    lost: threading.Event = field(default_factory=threading.Event)


class Heartbeat:
    """Renews the leases this process holds, from one thread, every third of the lease.
    A lease that cannot be renewed is marked lost (and no longer renewed); a registry
    that cannot be reached is tried again on the next beat."""

    def __init__(self, engine: Engine, table: Leased, lease_s: float, name: str) -> None:
        self.engine = engine
        self.table = table
        self.lease_s = lease_s
        self.held: dict[int, Lease] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread (once; ``hold`` starts it too)."""
        with self.lock:
            if not self.thread.is_alive() and not self.thread.ident:
                self.thread.start()

    def hold(self, row_id: int, token: str) -> Lease:
        """Keep renewing the lease ``token`` on ``row_id`` until ``release``."""
        return self.keep(Lease(row_id, token))

    def keep(self, lease: Lease) -> Lease:
        with self.lock:
            self.held[lease.row_id] = lease
        self.start()
        return lease

    def release(self, row_id: int) -> None:
        with self.lock:
            self.held.pop(row_id, None)

    def beat(self) -> None:
        """One round of renewals."""
        with self.lock:
            held = list(self.held.values())
        for lease in held:
            try:
                if not renew(self.engine, self.table, lease.row_id, lease.token, self.lease_s):
                    lease.lost.set()
                    with self.lock:
                        if self.held.get(lease.row_id) is lease:
                            del self.held[lease.row_id]
            except Exception as exc:  # the registry is down: keep trying
                log.warning(
                    "lease renewal failed",
                    table=self.table.__tablename__,
                    row=lease.row_id,
                    error=str(exc)[:200],
                )

    def _run(self) -> None:
        while not self.stop.wait(self.lease_s / 3):
            self.beat()
