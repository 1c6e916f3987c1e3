"""Deployments: which versions of a model serve, with what weights and pool policy.

Routing changes (create, canary, promote, rollback) each write a ``DeploymentRevision``;
rollback replays that history. Only ``ready`` versions may receive traffic.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from ember.errors import Conflict, InvalidInput, NotFound
from ember.logs import get_logger
from ember.registry import catalog, quotas
from ember.registry.pagination import paginate
from ember.registry.quotas import Limits
from ember.registry.schemas import (
    POLICY_FIELDS,
    CanaryRequest,
    DeploymentCreate,
    DeploymentPublic,
    DeploymentUpdate,
    PoolPolicy,
    PromoteRequest,
)
from ember.registry.tables import Deployment, DeploymentRevision, Model, ModelVersion

log = get_logger(__name__)
PRODUCTION, CANARY = "production", "canary"
NULLABLE = {"safe_default"}
"""Policy fields where null is a value (no default rung), not a missing one."""


def create(
    session: Session, tenant_id: int, body: DeploymentCreate, limits: Limits | None = None
) -> Deployment:
    """``limits``: the tenant's quotas, checked against the deployment's worst case before
    it is stored (None: an operator's own seeding, unchecked)."""
    name = body.name or body.model
    if _find(session, tenant_id, name) is not None:
        raise Conflict(f"deployment {name!r} already exists")
    model = catalog.get_model(session, tenant_id, body.model)
    _ready(session, model, body.version)
    for version in body.fallback:
        catalog.get_version(session, model, version)
    deployment = Deployment(
        tenant_id=tenant_id,
        name=name,
        model_id=model.id or 0,
        traffic={body.version: 100},
        aliases={PRODUCTION: body.version},
        policy=PoolPolicy.model_validate(body.model_dump(include=set(POLICY_FIELDS))).model_dump(),
        fallback=list(body.fallback),
        revision=0,
    )
    if limits is not None:
        quotas.check_deployment(session, limits, deployment, None)
    session.add(deployment)
    try:
        session.flush()
    except IntegrityError as exc:
        raise Conflict(f"deployment {name!r} already exists") from exc
    _record(session, deployment, "create")
    return deployment


def _find(session: Session, tenant_id: int, name: str) -> Deployment | None:
    query = select(Deployment).where(Deployment.tenant_id == tenant_id, Deployment.name == name)
    return session.exec(query).first()


def get(session: Session, tenant_id: int, name: str) -> Deployment:
    deployment = _find(session, tenant_id, name)
    if deployment is None:
        raise NotFound(f"deployment {name!r} does not exist")
    return deployment


def list_page(
    session: Session, tenant_id: int, limit: int, cursor: str | None
) -> tuple[list[Deployment], str | None]:
    query = select(Deployment).where(Deployment.tenant_id == tenant_id)
    return paginate(session, query, col(Deployment.id), limit, cursor)


def update(
    session: Session, deployment: Deployment, body: DeploymentUpdate, limits: Limits | None = None
) -> Deployment:
    before = quotas.footprint(deployment)
    changes = body.model_dump(exclude_unset=True)
    if "fallback" in changes:
        fallback = changes.pop("fallback") or []
        model = _model(session, deployment)
        for version in fallback:
            catalog.get_version(session, model, version)
        deployment.fallback = fallback
    if changes:
        nulls = sorted(k for k, v in changes.items() if v is None and k not in NULLABLE)
        if nulls:
            raise InvalidInput(f"policy fields cannot be null: {', '.join(nulls)}")
        merged = {**deployment.policy, **changes}
        try:
            deployment.policy = PoolPolicy.model_validate(merged).model_dump()
        except ValueError as exc:
            raise InvalidInput(_first_error(exc)) from exc
    if limits is not None:
        quotas.check_deployment(session, limits, deployment, before)
    deployment.updated_at = datetime.now(UTC)
    session.add(deployment)
    log.info("deployment updated", deployment=deployment.name, changes=sorted(changes))
    return deployment


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first: dict[str, Any] = errors()[0]
        return str(first.get("msg", exc)).removeprefix("Value error, ")
    return str(exc)


def canary(
    session: Session, deployment: Deployment, body: CanaryRequest, limits: Limits | None = None
) -> Deployment:
    before = quotas.footprint(deployment)
    production = deployment.aliases[PRODUCTION]
    if body.version == production:
        raise Conflict(f"version {body.version!r} is already production")
    _ready(session, _model(session, deployment), body.version)
    deployment.traffic = {production: 100 - body.weight, body.version: body.weight}
    deployment.aliases = {PRODUCTION: production, CANARY: body.version}
    if limits is not None:
        quotas.check_deployment(session, limits, deployment, before)
    return _record(session, deployment, f"canary {body.version} at {body.weight}%")


def promote(session: Session, deployment: Deployment, body: PromoteRequest) -> Deployment:
    version = body.version or deployment.aliases.get(CANARY)
    if version is None:
        raise Conflict("there is no canary to promote; name a version")
    if version == deployment.aliases[PRODUCTION] and CANARY not in deployment.aliases:
        raise Conflict(f"version {version!r} is already production")
    _ready(session, _model(session, deployment), version)
    deployment.traffic = {version: 100}
    deployment.aliases = {PRODUCTION: version}
    return _record(session, deployment, f"promote {version}")


def rollback(session: Session, deployment: Deployment) -> Deployment:
    """Drop an active canary; otherwise return production to the version before it."""
    production = deployment.aliases[PRODUCTION]
    if CANARY in deployment.aliases:
        deployment.traffic = {production: 100}
        deployment.aliases = {PRODUCTION: production}
        return _record(session, deployment, f"rollback canary {production}")
    lineage = _production_lineage(session, deployment)
    if len(lineage) < 2:
        raise Conflict("nothing to roll back to: production has had only one version")
    previous = lineage[-2]
    _ready(session, _model(session, deployment), previous)
    deployment.traffic = {previous: 100}
    deployment.aliases = {PRODUCTION: previous}
    return _record(session, deployment, f"rollback {previous}")


def _production_lineage(session: Session, deployment: Deployment) -> list[str]:
    """The stack of production versions: create/promote push, a production rollback pops."""
    stack: list[str] = []
    for rev in revisions(session, deployment):
        kind = rev.reason.split(" ", 1)[0]
        if kind in ("create", "promote"):
            stack.append(rev.aliases[PRODUCTION])
        elif kind == "rollback" and not rev.reason.startswith("rollback canary") and stack:
            stack.pop()
    return stack


def revisions(session: Session, deployment: Deployment) -> list[DeploymentRevision]:
    query = (
        select(DeploymentRevision)
        .where(DeploymentRevision.deployment_id == deployment.id)
        .order_by(col(DeploymentRevision.revision))
    )
    return list(session.exec(query))


def delete(session: Session, deployment: Deployment) -> None:
    for rev in revisions(session, deployment):
        session.delete(rev)
    session.flush()
    session.delete(deployment)


def public(session: Session, deployment: Deployment) -> DeploymentPublic:
    model = _model(session, deployment)
    return DeploymentPublic.model_validate(
        {**deployment.policy, **deployment.model_dump(exclude={"policy"}), "model": model.name}
    )


def _model(session: Session, deployment: Deployment) -> Model:
    model = session.get(Model, deployment.model_id)
    if model is None:  # guarded by the foreign key; kept for a clear error
        raise NotFound(f"the model of deployment {deployment.name!r} no longer exists")
    return model


def _ready(session: Session, model: Model, version: str) -> ModelVersion:
    row = catalog.get_version(session, model, version)
    catalog.require_ready(model, row)
    return row


def _record(session: Session, deployment: Deployment, reason: str) -> Deployment:
    deployment.revision += 1
    deployment.updated_at = datetime.now(UTC)
    session.add(deployment)
    session.add(
        DeploymentRevision(
            deployment_id=deployment.id or 0,
            revision=deployment.revision,
            traffic=dict(deployment.traffic),
            aliases=dict(deployment.aliases),
            reason=reason,
        )
    )
    session.flush()
    log.info("deployment routing changed", deployment=deployment.name, reason=reason,
             traffic=deployment.traffic)  # fmt: skip
    return deployment
