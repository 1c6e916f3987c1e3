"""Models and versions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Path, Request, Response, status

from ember.api.deps import Cursor, Limit, PrincipalDep, SessionDep, SettingsDep
from ember.domain import trust
from ember.registry import catalog
from ember.registry.schemas import (
    NAME_PATTERN,
    VERSION_PATTERN,
    CostModelPublic,
    ModelCreate,
    ModelPublic,
    ModelVersionCreate,
    ModelVersionPublic,
    Page,
)
from ember.registry.tables import Tenant, VersionStatus

router = APIRouter(prefix="/v1/models", tags=["models"])
ModelName = Annotated[str, Path(pattern=NAME_PATTERN, description="Model name.")]
VersionRef = Annotated[str, Path(pattern=VERSION_PATTERN, description="Version.")]


@router.post("", status_code=status.HTTP_201_CREATED, summary="Create a model")
def create_model(body: ModelCreate, principal: PrincipalDep, session: SessionDep) -> ModelPublic:
    model = catalog.create_model(session, principal.tenant_id, body)
    session.commit()
    return catalog.model_public(session, model)


@router.get("", summary="List models")
def list_models(
    principal: PrincipalDep, session: SessionDep, limit: Limit = 50, cursor: Cursor = None
) -> Page[ModelPublic]:
    items, next_cursor = catalog.list_models(session, principal.tenant_id, limit, cursor)
    return Page(items=items, next_cursor=next_cursor)


@router.get("/{name}", summary="Get a model")
def get_model(name: ModelName, principal: PrincipalDep, session: SessionDep) -> ModelPublic:
    return catalog.model_public(session, catalog.get_model(session, principal.tenant_id, name))


@router.delete(
    "/{name}", status_code=status.HTTP_204_NO_CONTENT, summary="Delete a model and its versions"
)
def delete_model(name: ModelName, principal: PrincipalDep, session: SessionDep) -> Response:
    """Refused (409) while a deployment serves the model."""
    catalog.delete_model(session, principal.tenant_id, name)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/{name}/versions",
    status_code=status.HTTP_201_CREATED,
    summary="Register a version",
    responses={202: {"model": ModelVersionPublic, "description": "Accepted; validating"}},
)
def register_version(
    name: ModelName,
    body: ModelVersionCreate,
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
    request: Request,
    response: Response,
    background: BackgroundTasks,
) -> ModelVersionPublic:
    """Validates the artifact (safetensors header, sha256, size, tensor count). Small
    artifacts are validated before the answer (201, `ready`); large ones answer 202 with
    status `pending` and validate in the background — poll the version.

    The code a version names is checked first (422 naming it): a torch factory must
    match `EMBER_ENGINE_FACTORIES` unless an admin marked the tenant trusted; vLLM
    `vllm_args` only tuning flags."""
    model = catalog.get_model(session, principal.tenant_id, name)
    tenant = session.get(Tenant, principal.tenant_id)
    trust.check_version_code(  # before anything is stored or the artifact is read
        body.engine,
        body.engine_config,
        settings.engine_factories,
        settings.vllm_args_allowed,
        trusted=tenant is not None and tenant.trusted,
    )
    version = catalog.register_version(session, settings, model, body, principal)
    session.commit()
    if version.status is VersionStatus.pending and version.id is not None:
        response.status_code = status.HTTP_202_ACCEPTED
        background.add_task(request.app.state.validator.submit, version.id)
    response.headers["Location"] = f"/v1/models/{model.name}/versions/{version.version}"
    return catalog.version_public(model, version)


@router.get("/{name}/versions", summary="List versions")
def list_versions(
    name: ModelName,
    principal: PrincipalDep,
    session: SessionDep,
    limit: Limit = 50,
    cursor: Cursor = None,
) -> Page[ModelVersionPublic]:
    model = catalog.get_model(session, principal.tenant_id, name)
    rows, next_cursor = catalog.list_versions(session, model, limit, cursor)
    return Page(items=[catalog.version_public(model, v) for v in rows], next_cursor=next_cursor)


@router.get("/{name}/versions/{version}", summary="Get a version")
def get_version(
    name: ModelName, version: VersionRef, principal: PrincipalDep, session: SessionDep
) -> ModelVersionPublic:
    model = catalog.get_model(session, principal.tenant_id, name)
    return catalog.version_public(model, catalog.get_version(session, model, version))


@router.delete(
    "/{name}/versions/{version}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete an unused version",
)
def delete_version(
    name: ModelName, version: VersionRef, principal: PrincipalDep, session: SessionDep
) -> Response:
    """Refused (409) while a deployment routes to it, aliases it or falls back to it."""
    model = catalog.get_model(session, principal.tenant_id, name)
    catalog.delete_version(session, model, version)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.put(
    "/{name}/versions/{version}/cost-models/{hardware}", summary="Store a calibration (admin)"
)
def put_cost_model(
    name: ModelName,
    version: VersionRef,
    hardware: Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")],
    body: CostModelPublic,
    principal: PrincipalDep,
    session: SessionDep,
) -> ModelVersionPublic:
    """What `ember calibrate` measured for this version on this hardware: admission, the
    router and the autoscaler read model units from here. Admin keys only (for a tenant's
    version: `X-Ember-Tenant`): a tenant writing its own cost (zero) would never empty
    its admission budget."""
    principal.require_admin()
    model = catalog.get_model(session, principal.tenant_id, name)
    row = catalog.get_version(session, model, version)
    catalog.set_cost_model(row, hardware, body)
    session.add(row)
    session.commit()
    return catalog.version_public(model, row)
