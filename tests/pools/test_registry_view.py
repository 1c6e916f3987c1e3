"""The pools controller's view of the registry: re-read whole only when a change shows in
the fingerprint (or the periodic full read is due), and a change made elsewhere — another
API process, the CLI — is seen at the next check."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from ember.api.app import prepare
from ember.config import Settings
from ember.pools.backends.local import LocalProcessBackend
from ember.pools.controller import PoolsController
from ember.pools.registry_view import REGISTRY_FULL_S
from ember.registry.db import session_scope
from ember.registry.tables import Deployment, Model, ModelVersion, Tenant, VersionStatus


def test_the_view_is_read_again_only_when_the_registry_changed(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(data_dir=data_dir)
    engine, _ = prepare(settings)
    with session_scope(engine) as s:
        tenant = Tenant(name="acme")
        s.add(tenant)
        s.flush()
        model = Model(tenant_id=tenant.id, name="m")
        s.add(model)
        s.flush()
        ready = VersionStatus.ready
        s.add(ModelVersion(model_id=model.id, version="1", artifact_uri="file:///x",
                           engine="torch", status=ready, sha256="0" * 64))  # fmt: skip
        s.add(Deployment(tenant_id=tenant.id, name="m", model_id=model.id,
                         traffic={"1": 100}, policy={"min_hot": 1}))  # fmt: skip
    controller = PoolsController(engine, LocalProcessBackend(settings))
    reads = 0
    real = controller.registry.read

    def counted() -> dict:  # type: ignore[type-arg]
        nonlocal reads
        reads += 1
        return real()

    monkeypatch.setattr(controller.registry, "read", counted)
    controller._read_if_changed(100.0)
    assert reads == 1 and controller.deployments[(tenant.id, "m")].policy.min_hot == 1
    controller._read_if_changed(101.0)
    controller._read_if_changed(102.0)
    assert reads == 1  # nothing changed: only the fingerprint was read

    with session_scope(engine) as s:  # a change made by someone else
        row = s.get(Deployment, 1)
        assert row is not None
        row.policy = {"min_hot": 3}
        row.updated_at = datetime.now(UTC)
        s.add(row)
    controller._read_if_changed(103.0)
    assert reads == 2 and controller.deployments[(tenant.id, "m")].policy.min_hot == 3
    controller._read_if_changed(103.0 + REGISTRY_FULL_S)  # the periodic full read
    assert reads == 3
    controller.refresh()  # an API write in this process: read now, changed or not
    assert reads == 4
