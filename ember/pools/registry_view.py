"""The pools controller's reader of the registry: what every deployment routes to, read as
:class:`~ember.serving.routing.DeploymentView` values, and a cheap fingerprint that says
when that view is worth reading again.

A full read every second cost 12-17 ms of CPU per second on an idle API, so
:meth:`RegistryView.read_if_changed` reads the fingerprint (deployments, running batch
runs, ready versions) and the whole view only when it changed, or every
:data:`REGISTRY_FULL_S` regardless (calibrated cost models carry no timestamp). The reader
holds only its own bookkeeping; the controller keeps what it returns.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Engine, func
from sqlalchemy import select as sa_select
from sqlmodel import col, select

from ember.costmodel import hardware_key
from ember.domain.spec import DeploymentKey, VersionSpec
from ember.registry import catalog
from ember.registry.db import session_scope
from ember.registry.schemas import PoolPolicy
from ember.registry.tables import (
    BatchRun,
    Deployment,
    Model,
    ModelVersion,
    Tenant,
    VersionStatus,
)
from ember.serving.routing import DeploymentView

REGISTRY_FULL_S = 10.0
"""The registry view is re-read whole at least this often, changed or not."""


class RegistryView:
    """Reads the deployments from ``db``: :meth:`due` paces the checks (policy changes
    apply within ``every_s``), :meth:`read_if_changed` reads when the fingerprint moved."""

    def __init__(self, db: Engine, *, every_s: float = 1.0, hardware: str | None = None) -> None:
        self.db = db
        self.every_s = every_s
        self.hardware = hardware or hardware_key("cpu")
        """The hardware the versions' cost models are picked for."""
        self.tenant_names: dict[int, str] = {}
        """Tenant id -> name, as of the last full read (the metrics' ``tenant`` labels)."""
        self._last_check = self._last_full_read = -math.inf
        self._fingerprint: tuple[Any, ...] | None = None

    def due(self, now: float) -> bool:
        """Whether a check is due at ``now`` (then it counts as made)."""
        if now - self._last_check < self.every_s:
            return False
        self._last_check = now
        return True

    def read_if_changed(
        self, now: float, *, force: bool = False
    ) -> dict[DeploymentKey, DeploymentView] | None:
        """The whole view when the fingerprint changed since the last read, the periodic
        full read is due, or ``force``; else ``None`` (keep the view read before).
        Blocking: call it from a thread."""
        if force:  # a read asked for now (an API write) is this interval's check too
            self._last_check = now
        fingerprint = self.fingerprint()
        due = now - self._last_full_read >= REGISTRY_FULL_S
        if not (force or due or fingerprint != self._fingerprint):
            return None
        self._fingerprint = fingerprint
        self._last_full_read = now
        return self.read()

    def fingerprint(self) -> tuple[Any, ...]:
        """What routing depends on, cheaply: the deployments' count, last update and ids,
        the ready versions' count and last validation, and the running batch runs."""
        with self.db.connect() as conn:
            deployments = conn.execute(
                sa_select(
                    func.count(), func.max(Deployment.updated_at), func.sum(Deployment.id)
                ).select_from(Deployment)
            ).one()
            versions = conn.execute(
                sa_select(func.count(), func.max(ModelVersion.validated_at)).where(
                    col(ModelVersion.status) == VersionStatus.ready
                )
            ).one()
            runs = conn.execute(
                sa_select(col(BatchRun.tenant_id), col(BatchRun.deployment), col(BatchRun.version))
                .where(col(BatchRun.status) == "running")
                .order_by(col(BatchRun.id))
            ).all()
        return tuple(deployments), tuple(versions), tuple(tuple(r) for r in runs)

    def read(self) -> dict[DeploymentKey, DeploymentView]:
        """Every deployment with the ready versions it may route to: those with traffic,
        its fallbacks and the versions running batch runs are pinned to."""
        views: dict[DeploymentKey, DeploymentView] = {}
        with session_scope(self.db) as session:
            pins: dict[DeploymentKey, set[str]] = {}
            for run in session.exec(select(BatchRun).where(BatchRun.status == "running")):
                run_key = DeploymentKey(run.tenant_id, run.deployment)
                pins.setdefault(run_key, set()).add(run.version)
            tenants = {t.id: t for t in session.exec(select(Tenant)) if t.id is not None}
            self.tenant_names = {i: t.name for i, t in tenants.items()}
            for d in session.exec(select(Deployment)):
                model = session.get(Model, d.model_id)
                if model is None:
                    continue
                pinned = pins.get(DeploymentKey(d.tenant_id, d.name), set())
                wanted = {v for v, w in d.traffic.items() if w > 0} | set(d.fallback) | pinned
                rows = [
                    r
                    for r in session.exec(
                        select(ModelVersion).where(
                            ModelVersion.model_id == model.id,
                            col(ModelVersion.version).in_(wanted),
                        )
                    )
                    if r.status is VersionStatus.ready
                ]
                tenant = tenants.get(d.tenant_id)  # trusted: replicas skip code checks
                trusted = {"trusted": bool(tenant is not None and tenant.trusted)}
                specs = {
                    r.version: VersionSpec.model_validate(
                        catalog.version_spec(model, r, self.hardware) | trusted
                    )
                    for r in rows
                }
                views[DeploymentKey(d.tenant_id, d.name)] = DeploymentView(
                    d.tenant_id,
                    d.name,
                    model.name,
                    dict(d.traffic),
                    PoolPolicy.model_validate(d.policy),
                    specs,
                    list(d.fallback),
                    sorted(pinned),
                    {r.version: r.size_bytes for r in rows if r.size_bytes},
                )
        return views
