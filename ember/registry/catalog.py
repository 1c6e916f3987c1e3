"""Models and their immutable versions, scoped to a tenant."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from ember.config import Settings
from ember.errors import Conflict, NotFound
from ember.logs import get_logger, model_context
from ember.registry import validation
from ember.registry.pagination import paginate
from ember.registry.schemas import (
    CostModelPublic,
    ModelCreate,
    ModelPublic,
    ModelVersionCreate,
    ModelVersionPublic,
)
from ember.registry.tables import Deployment, Model, ModelVersion, VersionStatus
from ember.registry.tenants import Principal

log = get_logger(__name__)


def create_model(session: Session, tenant_id: int, body: ModelCreate) -> Model:
    if _find_model(session, tenant_id, body.name) is not None:
        raise Conflict(f"model {body.name!r} already exists")
    model = Model(tenant_id=tenant_id, name=body.name, description=body.description)
    session.add(model)
    try:
        session.flush()
    except IntegrityError as exc:
        raise Conflict(f"model {body.name!r} already exists") from exc
    return model


def _find_model(session: Session, tenant_id: int, name: str) -> Model | None:
    query = select(Model).where(Model.tenant_id == tenant_id, Model.name == name)
    return session.exec(query).first()


def get_model(session: Session, tenant_id: int, name: str) -> Model:
    model = _find_model(session, tenant_id, name)
    if model is None:
        raise NotFound(f"model {name!r} does not exist")
    return model


def list_models(
    session: Session, tenant_id: int, limit: int, cursor: str | None
) -> tuple[list[ModelPublic], str | None]:
    query = select(Model).where(Model.tenant_id == tenant_id)
    rows, next_cursor = paginate(session, query, col(Model.id), limit, cursor)
    return [model_public(session, m) for m in rows], next_cursor


def model_public(session: Session, model: Model) -> ModelPublic:
    count = session.exec(
        select(func.count()).select_from(ModelVersion).where(ModelVersion.model_id == model.id)
    ).one()
    latest = session.exec(
        select(ModelVersion.version)
        .where(ModelVersion.model_id == model.id)
        .order_by(col(ModelVersion.id).desc())
    ).first()
    return ModelPublic(
        name=model.name,
        description=model.description,
        created_at=model.created_at,
        version_count=count,
        latest_version=latest,
    )


def delete_model(session: Session, tenant_id: int, name: str) -> None:
    model = get_model(session, tenant_id, name)
    serving = session.exec(select(Deployment.name).where(Deployment.model_id == model.id)).all()
    if serving:
        raise Conflict(
            f"model {name!r} is served by deployment(s) {', '.join(sorted(serving))}; "
            "delete those first",
            deployments=sorted(serving),
        )
    for version in session.exec(select(ModelVersion).where(ModelVersion.model_id == model.id)):
        session.delete(version)
    session.flush()
    session.delete(model)


def register_version(
    session: Session,
    settings: Settings,
    model: Model,
    body: ModelVersionCreate,
    principal: Principal | None = None,
) -> ModelVersion:
    """Store a new immutable version; validate now if small, else leave it ``pending``.

    A tenant key's ``artifact_uri`` must lie under its tenant's own prefix
    (``stores.tenant_prefixes``): refused before the object is looked at. Admin keys
    (acting for a tenant or not) and callers without a principal (the seeding at first
    start) may name any allowed location. Location errors (not allowed, not found) and,
    for inline validation, content errors raise before anything is stored, so a
    corrected registration can reuse the name.
    """
    confine = None if principal is None or principal.is_admin else principal.tenant
    if find_version(session, model, body.version) is not None:
        raise Conflict(f"version {body.version!r} of model {model.name!r} already exists")
    with model_context(model.name, body.version):
        info = validation.locate(body.artifact_uri, settings, confine)
        version = ModelVersion(
            model_id=model.id or 0,
            version=body.version,
            artifact_uri=info.uri,  # a directory's ends in "/"
            engine=body.engine,
            engine_config=body.engine_config,
            input_schema=body.input_schema,
            output_schema=body.output_schema,
            expected_sha256=body.sha256,
        )
        if info.uri.endswith("/") and info.size > settings.validate_inline_max_bytes:
            validation.check_directory(info.uri, settings, confine)  # its shape: a 422 now
        if info.size <= settings.validate_inline_max_bytes:
            facts = validation.inspect_artifact(info.uri, settings, body.sha256, confine)
            validation.apply_facts(version, facts)
        session.add(version)
        try:
            session.flush()
        except IntegrityError as exc:
            raise Conflict(
                f"version {body.version!r} of model {model.name!r} already exists"
            ) from exc
        log.info("version registered", status=version.status.value, uri=info.uri)
    return version


def find_version(session: Session, model: Model, version: str) -> ModelVersion | None:
    """The model's version called ``version``, or None."""
    query = select(ModelVersion).where(
        ModelVersion.model_id == model.id, ModelVersion.version == version
    )
    return session.exec(query).first()


def get_version(session: Session, model: Model, version: str) -> ModelVersion:
    row = find_version(session, model, version)
    if row is None:
        raise NotFound(f"version {version!r} of model {model.name!r} does not exist")
    return row


def list_versions(
    session: Session, model: Model, limit: int, cursor: str | None
) -> tuple[list[ModelVersion], str | None]:
    query = select(ModelVersion).where(ModelVersion.model_id == model.id)
    return paginate(session, query, col(ModelVersion.id), limit, cursor)


def delete_version(session: Session, model: Model, version: str) -> None:
    row = get_version(session, model, version)
    users = [
        d.name
        for d in session.exec(select(Deployment).where(Deployment.model_id == model.id))
        if version in d.traffic or version in d.aliases.values() or version in d.fallback
    ]
    if users:
        raise Conflict(
            f"version {version!r} is used by deployment(s) {', '.join(sorted(users))}",
            deployments=sorted(users),
        )
    session.delete(row)


def version_public(model: Model, row: ModelVersion) -> ModelVersionPublic:
    data = row.model_dump()
    data["cost_models"] = data.get("cost_models") or {}
    return ModelVersionPublic.model_validate({**data, "model": model.name})


def set_cost_model(row: ModelVersion, hardware: str, cost: CostModelPublic) -> None:
    row.cost_models = {**(row.cost_models or {}), hardware: cost.model_dump()}


def require_ready(model: Model, row: ModelVersion) -> None:
    if row.status is not VersionStatus.ready:
        reason = f": {row.status_reason}" if row.status_reason else ""
        raise Conflict(
            f"version {row.version!r} of model {model.name!r} is {row.status.value}{reason}; "
            "only ready versions can serve",
            status=row.status.value,
        )


def version_spec(model: Model, row: ModelVersion, hardware: str | None = None) -> dict[str, Any]:
    """What a replica needs to serve ``row`` (``ember.domain.spec.VersionSpec`` fields),
    with the cost model calibrated on ``hardware`` if there is one."""
    return {
        "cost": (row.cost_models or {}).get(hardware or "") if hardware else None,
        "model": model.name,
        "version": row.version,
        "artifact_uri": row.artifact_uri,
        "sha256": row.sha256 or "",
        "files": row.files,
        "engine": row.engine,
        "engine_config": row.engine_config,
        "input_schema": row.input_schema,
        "output_schema": row.output_schema,
    }
