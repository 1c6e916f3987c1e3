"""Which deployment and version a ``model[:version-or-alias]`` reference means: the rule a
job's submission and a batch run's plan both resolve with (the gateway's own).
"""

from __future__ import annotations

from sqlmodel import Session, select

from ember.errors import NotFound
from ember.registry import catalog
from ember.registry.tables import Deployment, Model, ModelVersion, VersionStatus


def serving_deployment(session: Session, tenant_id: int, model: Model) -> Deployment:
    """The deployment named after the model, else the first that serves it (the gateway's
    rule)."""
    rows = session.exec(
        select(Deployment).where(Deployment.tenant_id == tenant_id, Deployment.model_id == model.id)
    ).all()
    if not rows:
        raise NotFound(
            f"no deployment serves model {model.name!r}; deploy it first", model=model.name
        )
    return sorted(rows, key=lambda d: (d.name != model.name, d.name))[0]


def resolve(
    session: Session, tenant_id: int, ref: str
) -> tuple[Model, Deployment, str | None, ModelVersion]:
    """``name[:version-or-alias]`` → model, deployment, the pinned version (None: the
    traffic split decides) and the version whose schema and cost apply."""
    name, _, wanted = ref.partition(":")
    model = catalog.get_model(session, tenant_id, name)
    deployment = serving_deployment(session, tenant_id, model)
    served = {v for v, w in deployment.traffic.items() if w > 0} | set(deployment.fallback)
    pinned: str | None = None
    if wanted:
        pinned = deployment.aliases.get(wanted, wanted)
        row = catalog.find_version(session, model, pinned)
        if row is None:
            raise NotFound(f"model {name!r} has no version or alias {wanted!r}")
        if pinned not in served:
            raise NotFound(
                f"version {pinned!r} of {name!r} is not served by deployment "
                f"{deployment.name!r} (served: {', '.join(sorted(served)) or 'none'})"
            )
    else:
        live = sorted((w, v) for v, w in deployment.traffic.items() if w > 0)
        production = deployment.aliases.get("production") or (live[-1][1] if live else None)
        row = catalog.find_version(session, model, production) if production else None
        if row is None:
            raise NotFound(f"deployment {deployment.name!r} serves no version")
    if row.status is not VersionStatus.ready:
        catalog.require_ready(model, row)
    return model, deployment, pinned, row
