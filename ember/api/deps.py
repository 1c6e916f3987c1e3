"""Injectables for routes, named to read as prose (``SessionDep``, ``PrincipalDep``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import Depends, Header, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from sqlmodel import Session

from ember.config import Settings
from ember.errors import EmberError, Unauthenticated
from ember.logs import get_logger
from ember.registry.security import hash_key
from ember.registry.tenants import Principal, authenticate

log = get_logger(__name__)
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
    them at once (other API processes see it within ``ttl_s``).

    Refresh ahead: a hit on an entry past half its life re-authenticates the key in a
    worker thread while the entry keeps answering, so a key in steady use never expires
    and no request waits for the database (without it, one request per key every
    ``ttl_s`` went the slow way: at 10 req/s that is the p99). A key found revoked or
    unknown by the refresh is dropped; a key unused for ``ttl_s`` still expires."""

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.entries: dict[tuple[str, str | None], tuple[float, Principal]] = {}
        self.refreshing: set[tuple[str, str | None]] = set()
        self.generation = 0
        """Bumped by every revocation: a refresh that read the database before it must
        not put the revoked principal back."""

    def get(
        self,
        key: tuple[str, str | None],
        refresh: Callable[[], Principal] | None = None,
    ) -> Principal | None:
        """The cached principal, or None. With ``refresh`` (called in a worker thread;
        the caller runs on the event loop), an entry past half its life is refreshed."""
        hit = self.entries.get(key)
        now = time.monotonic()
        if hit is None or hit[0] < now:
            return None
        if refresh is not None and hit[0] - now < self.ttl_s / 2 and key not in self.refreshing:
            self._refresh_ahead(key, refresh)
        return hit[1]

    def put(self, key: tuple[str, str | None], principal: Principal) -> None:
        if len(self.entries) >= self.max_entries:
            self.entries.clear()
        self.entries[key] = (time.monotonic() + self.ttl_s, principal)

    def forget_key(self, key_id: int) -> None:
        self.generation += 1
        self.entries = {k: v for k, v in self.entries.items() if v[1].key_id != key_id}

    def _refresh_ahead(self, key: tuple[str, str | None], refresh: Callable[[], Principal]) -> None:
        loop = asyncio.get_running_loop()
        generation = self.generation
        self.refreshing.add(key)

        def settle(principal: Principal | None, failed: bool) -> None:  # on the loop
            self.refreshing.discard(key)
            if generation != self.generation:
                return
            if principal is not None:
                self.put(key, principal)
            elif not failed:
                self.entries.pop(key, None)

        def run() -> None:
            try:
                principal = refresh()
            except EmberError:  # revoked, unknown, its tenant gone: drop it
                loop.call_soon_threadsafe(settle, None, False)
            except Exception as exc:  # the database is away: the entry runs out as before
                log.warning("could not refresh a cached API key", error=str(exc)[:200])
                loop.call_soon_threadsafe(settle, None, True)
            else:
                loop.call_soon_threadsafe(settle, principal, False)

        loop.run_in_executor(None, run)


def refresher(engine: Any, credentials: str, tenant: str | None) -> Callable[[], Principal]:
    """Re-authenticates ``credentials`` (``PrincipalCache.get``'s ``refresh``)."""

    def refresh() -> Principal:
        with Session(engine) as session:
            return authenticate(session, credentials, tenant)

    return refresh


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
    refresh = refresher(request.app.state.engine, credentials.credentials, x_ember_tenant)
    principal = cache.get(cache_key, refresh)
    if principal is None:
        principal = refresh()
        cache.put(cache_key, principal)
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def cached_principal(
    cache: PrincipalCache, authorization: str | None, tenant: str | None, engine: Any
) -> Principal | None:
    """The principal ``get_principal`` cached for these headers (read as ``HTTPBearer``
    reads them), or None: a lean lane leaves a miss to the dependency, which authenticates
    (and caches) or refuses."""
    scheme, credentials = get_authorization_scheme_param(authorization)
    if scheme.lower() != "bearer" or not credentials or len(credentials) > 512:
        return None
    return cache.get((hash_key(credentials), tenant), refresher(engine, credentials, tenant))


Limit = Annotated[int, Query(ge=1, le=500, description="Page size.")]
Cursor = Annotated[
    str | None, Query(max_length=128, description="`next_cursor` from the previous page.")
]
