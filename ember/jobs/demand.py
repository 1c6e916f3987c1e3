"""Queued async work per deployment, in model units: the autoscaler's async demand.

The pools controller calls a ``QueuedDemand`` (its ``async_demand`` hook) from a thread
once per registry read; the units of every unfinished job (queued, or running and not
done) are added to the deployment's queued units, so a backlog keeps replicas from
scaling down and scales them up to drain it (within ``max_replicas``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import Engine, func
from sqlmodel import Session, col, select

from ember.jobs import records
from ember.logs import get_logger
from ember.registry.tables import Job

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ember.config import Settings

log = get_logger(__name__)


class QueuedDemand:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last: dict[tuple[int, str], float] = {}

    def __call__(self) -> dict[tuple[int, str], float]:
        """(tenant id, deployment) → model units of unfinished jobs."""
        try:
            with Session(self.engine) as session:
                rows = session.exec(
                    select(Job.tenant_id, Job.deployment, func.sum(Job.units))
                    .where(col(Job.status).in_(records.UNFINISHED))
                    .group_by(col(Job.tenant_id), col(Job.deployment))
                ).all()
            self.last = {(t, d): float(u or 0.0) for t, d, u in rows}
        except Exception as exc:  # never break the controller's tick: keep the last figure
            log.warning("queued job demand unavailable", error=str(exc)[:200])
        return self.last


def attach(app: FastAPI, settings: Settings) -> None:
    """At API start: the job publisher (the pools controller is given a ``QueuedDemand``
    at construction, ``ember.api.app.start_pools``)."""
    from ember.jobs.queue import Publisher

    app.state.job_publisher = Publisher(settings)
    app.state.job_publisher.warm()


def detach(app: FastAPI) -> None:
    publisher = getattr(app.state, "job_publisher", None)
    if publisher is not None:
        publisher.close()
