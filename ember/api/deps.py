"""Injectables for routes, named to read as prose (``SessionDep``, ``PrincipalDep``)."""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import Depends, Header, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool

from ember import tracing
from ember.api.ratelimit import RateLimiter
from ember.config import Settings
from ember.errors import EmberError, RateLimited, Unauthenticated
from ember.logs import get_logger
from ember.registry.security import hash_key
from ember.registry.tenants import Principal, authenticate

log = get_logger(__name__)
_bearer = HTTPBearer(auto_error=False, description="An Ember API key.")
CacheKey = tuple[str, str | None]
"""The principal cache's key: the API key's digest and ``X-Ember-Tenant``."""


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

    Refusals are cached too (an unknown or revoked key, a tenant it may not act for),
    for ``refusal_ttl_s``, apart from the keys that worked (a flood of bad keys neither
    reaches the database per request nor evicts good keys). A miss is looked up in a
    worker thread, once however many requests wait for it: the event loop never waits
    on the database.

    Refresh ahead: a hit on an entry past half its life re-authenticates the key in a
    worker thread while the entry keeps answering, so a key in steady use never expires
    and no request waits for the database (without it, one request per key every
    ``ttl_s`` went the slow way: at 10 req/s that is the p99). A key found revoked or
    unknown by the refresh is dropped; a key unused for ``ttl_s`` still expires."""

    def __init__(
        self, ttl_s: float = 5.0, max_entries: int = 10_000, refusal_ttl_s: float = 5.0
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.refusal_ttl_s = refusal_ttl_s
        self.entries: dict[tuple[str, str | None], tuple[float, Principal]] = {}
        self.refusals: dict[tuple[str, str | None], tuple[float, EmberError]] = {}
        self.loading: dict[tuple[str, str | None], asyncio.Future[Principal]] = {}
        """Look-ups in flight (``load``), shared by the requests that wait for them."""
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

    def forget_tenant(self, tenant_id: int) -> None:
        """Drop the principals acting for ``tenant_id`` (its quotas changed)."""
        self.generation += 1
        self.entries = {k: v for k, v in self.entries.items() if v[1].tenant_id != tenant_id}

    def refused(self, key: tuple[str, str | None]) -> EmberError | None:
        """A fresh copy of the refusal cached for these credentials, or None. (A copy: an
        exception raised again and again would grow its traceback with every raise.)"""
        hit = self.refusals.get(key)
        if hit is None or hit[0] < time.monotonic():
            return None
        fresh = Exception.__new__(type(hit[1]))
        fresh.__dict__.update(hit[1].__dict__)
        fresh.args = hit[1].args
        return fresh

    def refuse(self, key: tuple[str, str | None], error: EmberError) -> None:
        if len(self.refusals) >= self.max_entries:
            self.refusals.clear()
        self.refusals[key] = (time.monotonic() + self.refusal_ttl_s, error)

    def forget_refusals(self) -> None:
        """A tenant was created: what was refused as "no such tenant" may work now."""
        self.refusals.clear()

    async def load(self, key: CacheKey, refresh: Callable[[], Principal]) -> Principal:
        """Authenticate a miss in a worker thread, once however many requests ask for the
        same key at once (a request that goes away does not cancel it), and cache the
        principal, or the refusal."""
        refused = self.refused(key)
        if refused is not None:
            raise refused
        task = self.loading.get(key)
        if task is None:
            task = asyncio.ensure_future(self._look_up(key, refresh))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
            self.loading[key] = task
        return await asyncio.shield(task)

    async def _look_up(self, key: CacheKey, refresh: Callable[[], Principal]) -> Principal:
        generation = self.generation
        try:
            principal = await run_in_threadpool(refresh)
        except EmberError as exc:  # unknown, revoked, may not act for that tenant
            self.refuse(key, exc)
            raise
        finally:  # anything else (the database is away) is not cached
            self.loading.pop(key, None)
        if generation == self.generation:  # no revocation while it was read
            self.put(key, principal)
        return principal

    def _refresh_ahead(self, key: tuple[str, str | None], refresh: Callable[[], Principal]) -> None:
        loop = asyncio.get_running_loop()
        generation = self.generation
        self.refreshing.add(key)

        def settle(principal: Principal | None, refusal: EmberError | None) -> None:  # on the loop
            self.refreshing.discard(key)
            if generation != self.generation:
                return
            if principal is not None:
                self.put(key, principal)
            elif refusal is not None:
                self.entries.pop(key, None)
                self.refuse(key, refusal)

        def run() -> None:
            try:
                principal = refresh()
            except EmberError as exc:  # revoked, unknown, its tenant gone: drop it
                loop.call_soon_threadsafe(settle, None, exc)
            except Exception as exc:  # the database is away: the entry runs out as before
                log.warning("could not refresh a cached API key", error=str(exc)[:200])
                loop.call_soon_threadsafe(settle, None, None)
            else:
                loop.call_soon_threadsafe(settle, principal, None)

        loop.run_in_executor(None, run)


def refresher(engine: Any, credentials: str, tenant: str | None) -> Callable[[], Principal]:
    """Re-authenticates ``credentials`` (``PrincipalCache.get``'s ``refresh``)."""

    def refresh() -> Principal:
        with Session(engine) as session:
            return authenticate(session, credentials, tenant)

    return refresh


def bearer_key(authorization: str | None) -> str | None:
    """The API key of an ``Authorization: Bearer <key>`` header, read as ``HTTPBearer``
    reads it (None: no header, another scheme, no key)."""
    scheme, credentials = get_authorization_scheme_param(authorization)
    return credentials if scheme.lower() == "bearer" and credentials else None


async def authenticate_key(state: Any, key: str | None, tenant: str | None) -> Principal:
    """The data plane's one authentication: ``key`` (and ``X-Ember-Tenant``) through the
    principal cache (``state``: the app's), looked up on a miss, or refused (401). The
    ``PrincipalDep`` dependency is this; the lean lane's tensor path, which FastAPI's
    dependencies never see, calls it directly."""
    if not key:
        raise Unauthenticated("send an API key as `Authorization: Bearer <key>`")
    if len(key) > 512:
        raise Unauthenticated("the API key is not valid (unknown or revoked)")
    cache: PrincipalCache = state.principals
    cache_key = (hash_key(key), tenant)
    refresh = refresher(state.engine, key, tenant)
    with tracing.span("auth"):
        principal = cache.get(cache_key, refresh)
        if principal is None:
            principal = await cache.load(cache_key, refresh)
    return principal


async def get_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    x_ember_tenant: Annotated[
        str | None,
        Header(description="Admin keys only: act for this tenant.", max_length=63),
    ] = None,
) -> Principal:
    """Every authenticated route's principal (``PrincipalDep``): ``authenticate_key``."""
    key = credentials.credentials if credentials is not None else None
    return await authenticate_key(request.app.state, key, x_ember_tenant)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def rate_limiter(request: Request) -> RateLimiter:
    """The API's rate limiter (``ember.api.ratelimit``)."""
    limiter: RateLimiter | None = getattr(request.app.state, "ratelimiter", None)
    if limiter is None:  # made on first use, on the serving event loop
        settings: Settings = request.app.state.settings
        limiter = request.app.state.ratelimiter = RateLimiter(settings.redis_url)
    return limiter


async def control_plane(
    request: Request,
    principal: PrincipalDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Every control-plane route's gate (``create_app`` puts it on their routers): worker
    keys are refused (403; they act on the data plane only), and each tenant key is held
    to its tenant's request rate (``EMBER_QUOTA_REQUESTS_PER_S``, burst
    ``EMBER_QUOTA_REQUEST_BURST``; shared by every API process through Redis): 429 with
    ``Retry-After`` beyond. Admin keys are not rate limited."""
    principal.require_control_plane()
    if principal.is_admin:
        return
    settings: Settings = request.app.state.settings
    rate = principal.requests_per_s or settings.quota_requests_per_s
    burst = max(1.0, settings.quota_request_burst * rate / settings.quota_requests_per_s)
    wait = await rate_limiter(request).hit(rate_key(credentials), rate, burst)
    if wait is not None:
        raise RateLimited(
            f"quota requests_per_s exceeded: this key may send {rate:g} control-plane "
            f"requests per second (bursts of {burst:g}); retry in {wait:.2f}s",
            retry_after_s=float(math.ceil(wait)),
            quota="requests_per_s",
        )


ControlPlane = Depends(control_plane)


def rate_key(credentials: HTTPAuthorizationCredentials | None) -> str:
    """The key's name in Redis: derived from its digest, so keys of two Ember
    installations that share one Redis never share a limit (their ids might)."""
    digest = hash_key(credentials.credentials if credentials else "")
    return hashlib.sha256(b"ember-rate:" + digest.encode()).hexdigest()[:32]


def cached_principal(
    cache: PrincipalCache, authorization: str | None, tenant: str | None, engine: Any
) -> Principal | None:
    """The principal ``authenticate_key`` cached for these headers, or None: a lean lane
    leaves a miss to the dependency, which authenticates (and caches) or refuses."""
    key = bearer_key(authorization)
    if key is None or len(key) > 512:
        return None
    with tracing.span("auth"):
        return cache.get((hash_key(key), tenant), refresher(engine, key, tenant))


Limit = Annotated[int, Query(ge=1, le=500, description="Page size.")]
Cursor = Annotated[
    str | None, Query(max_length=128, description="`next_cursor` from the previous page.")
]
