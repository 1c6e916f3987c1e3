"""Injectables for routes, named to read as prose (``SessionDep``, ``PrincipalDep``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from sqlmodel import Session

from ember.config import Settings
from ember.errors import Unauthenticated
from ember.registry.security import hash_key
from ember.registry.tenants import Principal, authenticate

_bearer = HTTPBearer(auto_error=False, description="An Ember API key.")


def get_session(request: Request) -> Iterator[Session]:
    # Routes commit explicitly (so a failed commit is still an error response);
    # whatever is left uncommitted is rolled back here.
    with Session(request.app.state.engine, expire_on_commit=False) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


class PrincipalCache:
    """Recently authenticated keys, so the hot path (``:predict``) does not hit the
    database per request. Entries live ``ttl_s``; a revocation in this process drops
    them at once (other API processes see it within ``ttl_s``)."""

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.entries: dict[tuple[str, str | None], tuple[float, Principal]] = {}

    def get(self, key: tuple[str, str | None]) -> Principal | None:
        hit = self.entries.get(key)
        if hit is None or hit[0] < time.monotonic():
            return None
        return hit[1]

    def put(self, key: tuple[str, str | None], principal: Principal) -> None:
        if len(self.entries) >= self.max_entries:
            self.entries.clear()
        self.entries[key] = (time.monotonic() + self.ttl_s, principal)

    def forget_key(self, key_id: int) -> None:
        self.entries = {k: v for k, v in self.entries.items() if v[1].key_id != key_id}


async def get_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    x_ember_tenant: Annotated[
        str | None,
        Header(description="Admin keys only: act for this tenant.", max_length=63),
    ] = None,
) -> Principal:
    if credentials is None or not credentials.credentials:
        raise Unauthenticated("send an API key as `Authorization: Bearer <key>`")
    if len(credentials.credentials) > 512:
        raise Unauthenticated("the API key is not valid (unknown or revoked)")
    cache: PrincipalCache = request.app.state.principals
    cache_key = (hash_key(credentials.credentials), x_ember_tenant)
    principal = cache.get(cache_key)
    if principal is None:
        with Session(request.app.state.engine) as session:
            principal = authenticate(session, credentials.credentials, x_ember_tenant)
        cache.put(cache_key, principal)
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def cached_principal(
    cache: PrincipalCache, authorization: str | None, tenant: str | None
) -> Principal | None:
    """The principal ``get_principal`` cached for these headers (read as ``HTTPBearer``
    reads them), or None: a lean lane leaves a miss to the dependency, which authenticates
    (and caches) or refuses."""
    scheme, credentials = get_authorization_scheme_param(authorization)
    if scheme.lower() != "bearer" or not credentials or len(credentials) > 512:
        return None
    return cache.get((hash_key(credentials), tenant))


Limit = Annotated[int, Query(ge=1, le=500, description="Page size.")]
Cursor = Annotated[
    str | None, Query(max_length=128, description="`next_cursor` from the previous page.")
]
