"""Tenants, API keys, authentication and first-start bootstrap."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from ember.errors import Conflict, Forbidden, NotFound, Unauthenticated
from ember.registry.security import display_prefix, generate_key, hash_key
from ember.registry.tables import ApiKey, KeyScope, Tenant

DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the key, the tenant it acts for, and its scope.

    Three scopes. ``tenant``: its own tenant's objects only. ``admin``: everything, for
    any tenant (``X-Ember-Tenant``). ``worker`` (the job and batch workers): the data
    plane for any tenant (``X-Ember-Tenant``), nothing on the control plane."""

    key_id: int
    tenant_id: int
    tenant: str
    scope: KeyScope
    requests_per_s: float | None = None
    """The tenant's control-plane rate override (None: ``EMBER_QUOTA_REQUESTS_PER_S``)."""

    @property
    def is_admin(self) -> bool:
        return self.scope is KeyScope.admin

    @property
    def is_worker(self) -> bool:
        return self.scope is KeyScope.worker

    def require_admin(self) -> None:
        if not self.is_admin:
            raise Forbidden("this action needs an admin key")

    def require_worker_or_admin(self) -> None:
        if self.scope not in (KeyScope.admin, KeyScope.worker):
            raise Forbidden("this action needs an admin or worker key")

    def require_control_plane(self) -> None:
        """Worker keys act on the data plane only."""
        if self.is_worker:
            raise Forbidden(
                "worker keys act on the data plane only (predict, :batch-lane); "
                "this route is the control plane"
            )


def get_tenant(session: Session, name: str) -> Tenant:
    tenant = session.exec(select(Tenant).where(Tenant.name == name)).first()
    if tenant is None:
        raise NotFound(f"tenant {name!r} does not exist")
    return tenant


def create_tenant(session: Session, name: str) -> Tenant:
    if session.exec(select(Tenant).where(Tenant.name == name)).first() is not None:
        raise Conflict(f"tenant {name!r} already exists")
    tenant = Tenant(name=name)
    session.add(tenant)
    try:
        session.flush()
    except IntegrityError as exc:  # a concurrent create won the race
        raise Conflict(f"tenant {name!r} already exists") from exc
    return tenant


def create_key(
    session: Session, tenant: Tenant, name: str, scope: KeyScope, key: str | None = None
) -> tuple[ApiKey, str]:
    """A new key for ``tenant``; returns the row and the secret (shown once)."""
    key = key or generate_key()
    row = ApiKey(
        tenant_id=tenant.id or 0,
        name=name,
        scope=scope,
        prefix=display_prefix(key),
        key_hash=hash_key(key),
    )
    session.add(row)
    session.flush()
    return row, key


def authenticate(session: Session, key: str, act_as: str | None = None) -> Principal:
    row = session.exec(select(ApiKey).where(ApiKey.key_hash == hash_key(key))).first()
    if row is None or row.revoked_at is not None:
        raise Unauthenticated("the API key is not valid (unknown or revoked)")
    tenant = session.get(Tenant, row.tenant_id)
    if tenant is None:
        raise Unauthenticated("the API key's tenant no longer exists")
    if act_as and act_as != tenant.name:
        if row.scope not in (KeyScope.admin, KeyScope.worker):
            raise Forbidden("only admin and worker keys may act for another tenant")
        tenant = get_tenant(session, act_as)
    rate = (tenant.quotas or {}).get("requests_per_s")
    return Principal(
        row.id or 0, tenant.id or 0, tenant.name, row.scope, float(rate) if rate else None
    )


def visible_keys(principal: Principal) -> Any:
    """The keys ``principal`` may list and revoke: an admin, every key of the tenant it
    acts for; a tenant key, its own tenant's tenant-scope keys (admin and worker keys are
    invisible to it, whatever their tenant)."""
    query = select(ApiKey).where(ApiKey.tenant_id == principal.tenant_id)
    if not principal.is_admin:
        query = query.where(ApiKey.scope == KeyScope.tenant)
    return query


def revoke_key(session: Session, principal: Principal, key_id: int) -> ApiKey:
    """Admins revoke any key; a tenant key only its own tenant's tenant-scope keys (any
    other is answered as absent)."""
    row = session.get(ApiKey, key_id)
    if row is None or (
        not principal.is_admin
        and (row.tenant_id != principal.tenant_id or row.scope is not KeyScope.tenant)
    ):
        raise NotFound(f"API key {key_id} does not exist")
    if row.revoked_at is None:
        row.revoked_at = datetime.now(UTC)
        session.add(row)
    return row


def bootstrap(session: Session, admin_key: str | None) -> str | None:
    """Ensure the default tenant and an admin key exist.

    Returns the admin key when one was generated now (to be shown once), else None.
    A configured ``admin_key`` is installed if it is not known yet, so scripted set-ups
    can rely on it on every start.
    """
    tenant = session.exec(select(Tenant).where(Tenant.name == DEFAULT_TENANT)).first()
    if tenant is None:
        tenant = Tenant(name=DEFAULT_TENANT)
        session.add(tenant)
        session.flush()
    if admin_key is not None:
        known = session.exec(select(ApiKey).where(ApiKey.key_hash == hash_key(admin_key))).first()
        if known is None:
            create_key(session, tenant, "admin", KeyScope.admin, admin_key)
        return None
    has_admin = session.exec(
        select(ApiKey).where(ApiKey.scope == KeyScope.admin, ApiKey.revoked_at == None)  # noqa: E711
    ).first()
    if has_admin is not None:
        return None
    _, key = create_key(session, tenant, "admin", KeyScope.admin)
    return key
