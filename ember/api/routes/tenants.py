"""Tenants and API keys."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, status
from sqlmodel import col, select

from ember.api.deps import Cursor, Limit, PrincipalDep, SessionDep
from ember.registry import tenants
from ember.registry.pagination import paginate
from ember.registry.schemas import (
    NAME_PATTERN,
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyPublic,
    Page,
    TenantCreate,
    TenantPublic,
    TenantUpdate,
)
from ember.registry.tables import ApiKey, KeyScope, Tenant

router = APIRouter(prefix="/v1", tags=["tenants"])
TenantName = Annotated[str, Path(pattern=NAME_PATTERN, description="Tenant name.")]


@router.post("/tenants", status_code=status.HTTP_201_CREATED, summary="Create a tenant (admin)")
def create_tenant(
    request: Request, body: TenantCreate, principal: PrincipalDep, session: SessionDep
) -> TenantPublic:
    principal.require_admin()
    tenant = tenants.create_tenant(session, body.name)
    tenant.trusted = body.trusted
    tenant.quotas = body.quotas.model_dump(exclude_none=True) or None
    session.add(tenant)
    session.commit()
    request.app.state.principals.forget_refusals()  # "no such tenant" to act for, cached
    return TenantPublic.model_validate(tenant)


@router.get("/tenants/{name}", summary="Get a tenant (admin)")
def get_tenant(name: TenantName, principal: PrincipalDep, session: SessionDep) -> TenantPublic:
    principal.require_admin()
    return TenantPublic.model_validate(tenants.get_tenant(session, name))


@router.patch("/tenants/{name}", summary="Mark a tenant trusted, or set its quotas (admin)")
def update_tenant(
    request: Request,
    name: TenantName,
    body: TenantUpdate,
    principal: PrincipalDep,
    session: SessionDep,
) -> TenantPublic:
    """Quotas take effect at once for deployments, jobs and batch runs; a changed request
    rate within the key cache's life (5 s) in each API process."""
    principal.require_admin()
    tenant = tenants.get_tenant(session, name)
    if body.trusted is not None:
        tenant.trusted = body.trusted
    if body.quotas is not None:
        tenant.quotas = body.quotas.model_dump(exclude_none=True) or None
    session.add(tenant)
    session.commit()
    request.app.state.principals.forget_tenant(tenant.id or 0)  # its rate, at once here
    return TenantPublic.model_validate(tenant)


@router.get("/tenants", summary="List tenants (admin)")
def list_tenants(
    principal: PrincipalDep, session: SessionDep, limit: Limit = 50, cursor: Cursor = None
) -> Page[TenantPublic]:
    principal.require_admin()
    rows, next_cursor = paginate(session, select(Tenant), col(Tenant.id), limit, cursor)
    return Page(items=[TenantPublic.model_validate(t) for t in rows], next_cursor=next_cursor)


def _key_public(key: ApiKey, tenant: str) -> ApiKeyPublic:
    return ApiKeyPublic.model_validate({**key.model_dump(), "tenant": tenant})


@router.post("/keys", status_code=status.HTTP_201_CREATED, summary="Create an API key")
def create_key(body: ApiKeyCreate, principal: PrincipalDep, session: SessionDep) -> ApiKeyCreated:
    """Tenant keys may create tenant keys for their own tenant; admin keys for any tenant,
    and admin and worker keys. The secret is returned once."""
    if body.scope is not KeyScope.tenant or (body.tenant and body.tenant != principal.tenant):
        principal.require_admin()
    tenant = tenants.get_tenant(session, body.tenant or principal.tenant)
    row, secret = tenants.create_key(session, tenant, body.name, body.scope)
    session.commit()
    return ApiKeyCreated(**_key_public(row, tenant.name).model_dump(), key=secret)


@router.get("/keys", summary="List API keys (never their secrets)")
def list_keys(
    principal: PrincipalDep, session: SessionDep, limit: Limit = 50, cursor: Cursor = None
) -> Page[ApiKeyPublic]:
    """An admin key lists every key of the tenant it acts for; a tenant key only its
    tenant's tenant-scope keys (admin and worker keys are not shown to it)."""
    query = tenants.visible_keys(principal)
    rows, next_cursor = paginate(session, query, col(ApiKey.id), limit, cursor)
    items = [_key_public(k, principal.tenant) for k in rows]
    return Page(items=items, next_cursor=next_cursor)


@router.delete(
    "/keys/{key_id}",
    summary="Revoke an API key",
    description="Admins revoke any key; a tenant key only its own tenant's tenant-scope "
    "keys (404 for any other, as if absent).",
)
def revoke_key(
    request: Request,
    key_id: Annotated[int, Path(ge=1, le=2**62)],
    principal: PrincipalDep,
    session: SessionDep,
) -> ApiKeyPublic:
    row = tenants.revoke_key(session, principal, key_id)
    session.commit()
    request.app.state.principals.forget_key(key_id)
    tenant = session.get(Tenant, row.tenant_id)
    return _key_public(row, tenant.name if tenant else "")


@router.get("/whoami", summary="The tenant and scope of the calling key")
def whoami(principal: PrincipalDep) -> dict[str, str]:
    return {"tenant": principal.tenant, "scope": principal.scope.value}
