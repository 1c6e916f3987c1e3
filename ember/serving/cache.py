"""The response cache: version-keyed, Redis-backed, with an in-process front and single flight.

A key is ``tenant : model : version : artifact sha256 : digest(canonical input, parameters)``,
so an answer can never be served for another version, another artifact or another tenant —
a promote or rollback changes the version the router picks, and with it the key.

Entries carry two horizons: *fresh* until the (jittered) TTL, then *stale* until the
deployment's ``cache_stale_s`` runs out; stale entries only serve as the degradation
ladder's ``cache`` rung. Concurrent identical misses are coalesced (single flight): in one
gateway process by sharing one in-flight future, across gateways by a short Redis lock
(``SET NX PX``) that followers poll for the leader's answer. Redis trouble never fails a
request: the cache then behaves as a miss and counts the error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ember.logs import get_logger

log = get_logger(__name__)
PREFIX = "ember:rc:v1:"
JITTER = 0.1
"""TTLs are shortened by up to this share at random, so entries stored together do not
all expire (and miss) together."""
LOCK_POLL_S = 0.005
REDIS_TIMEOUT_S = 0.05


def canonical(value: Any) -> bytes:
    """One byte string per JSON value: sorted keys, no whitespace."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest(value: Any) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


def cache_key(tenant_id: int, model: str, version: str, sha256: str, input_digest: str) -> str:
    return f"{tenant_id}:{model}:{version}:{sha256}:{input_digest}"


def fast_redis(url: str, timeout_s: float) -> Any:
    """An asyncio Redis client for the request path: every call gives up after
    ``timeout_s`` (the caller degrades instead of waiting) and no health-check round trip."""
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=0
    )


@dataclass(frozen=True)
class Entry:
    content: bytes
    """The answer's JSON bytes, as the replica produced them (sent on as they are)."""
    stored_at: float
    fresh_until: float
    stale_until: float

    def fresh(self, now: float) -> bool:
        return now < self.fresh_until

    def usable(self, now: float) -> bool:
        return now < self.stale_until

    def encode(self) -> bytes:
        """A JSON line of times, then the answer's bytes."""
        times = {"s": self.stored_at, "f": self.fresh_until, "u": self.stale_until}
        return canonical(times) + b"\n" + self.content

    @classmethod
    def decode(cls, raw: bytes) -> Entry | None:
        head, newline, content = raw.partition(b"\n")
        try:
            data = json.loads(head)
            entry = cls(content, float(data["s"]), float(data["f"]), float(data["u"]))
        except (ValueError, KeyError, TypeError):
            return None  # a foreign or corrupt value is a miss, never an answer
        return entry if newline and content else None


@dataclass
class CacheStats:
    hits: int = 0
    stale_hits: int = 0
    misses: int = 0
    coalesced: int = 0
    stores: int = 0
    errors: int = 0


class ResponseCache:
    def __init__(
        self,
        redis_url: str | None,
        *,
        front_entries: int = 4096,
        max_bytes: int = 1024 * 1024,
        rng: random.Random | None = None,
    ) -> None:
        self.redis: Any = fast_redis(redis_url, REDIS_TIMEOUT_S) if redis_url else None
        self.front: OrderedDict[str, Entry] = OrderedDict()
        self.front_entries = front_entries
        self.max_bytes = max_bytes
        self.flights: dict[str, asyncio.Future[bytes]] = {}
        self.stats = CacheStats()
        self.rng = rng or random.Random()
        self._redis_down_until = 0.0

    # --- lookups --------------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        """The entry (fresh or stale) if one is still usable, else None."""
        now = time.time()
        entry = self.front.get(key)
        if entry is not None:
            if entry.usable(now):
                self.front.move_to_end(key)
                return entry
            del self.front[key]
        raw = await self._redis_call("get", PREFIX + key)
        if raw is None:
            return None
        entry = Entry.decode(raw)
        if entry is None or not entry.usable(now):
            return None
        self._remember(key, entry)
        return entry

    async def put(self, key: str, content: bytes, ttl_s: float, stale_s: float) -> None:
        now = time.time()
        ttl = ttl_s * (1 - JITTER * self.rng.random())
        entry = Entry(content, now, now + ttl, now + ttl + stale_s)
        raw = entry.encode()
        if len(raw) > self.max_bytes:
            return
        self.stats.stores += 1
        self._remember(key, entry)
        await self._redis_call("set", PREFIX + key, raw, px=max(1, int((ttl + stale_s) * 1000)))

    def _remember(self, key: str, entry: Entry) -> None:
        if self.front_entries <= 0:
            return
        self.front[key] = entry
        self.front.move_to_end(key)
        while len(self.front) > self.front_entries:
            self.front.popitem(last=False)

    # --- single flight ----------------------------------------------------------------------

    async def single_flight(
        self,
        key: str,
        compute: Callable[[], Awaitable[bytes]],
        *,
        ttl_s: float,
        stale_s: float,
        deadline: float,
    ) -> tuple[bytes, bool]:
        """``compute()``'s answer (JSON bytes) for ``key``, computed once however many ask
        at once.

        Returns the answer and whether it came from another caller's computation. Errors of
        the computation reach every waiter; nothing is cached from a failure.
        """
        flight = self.flights.get(key)
        if flight is not None:
            self.stats.coalesced += 1
            return await asyncio.shield(flight), True
        flight = asyncio.get_running_loop().create_future()
        self.flights[key] = flight
        try:
            body, shared = await self._lead(key, compute, ttl_s, stale_s, deadline)
        except BaseException as exc:
            if not flight.done():
                flight.set_exception(exc)
                flight.exception()  # retrieved: waiters get it, no "never retrieved" warning
            raise
        else:
            flight.set_result(body)
            return body, shared
        finally:
            self.flights.pop(key, None)

    async def _lead(
        self,
        key: str,
        compute: Callable[[], Awaitable[bytes]],
        ttl_s: float,
        stale_s: float,
        deadline: float,
    ) -> tuple[bytes, bool]:
        lock = f"{PREFIX}lock:{key}"
        budget_ms = max(1, int((deadline - time.monotonic()) * 1000))
        acquired = await self._redis_call("set", lock, b"1", nx=True, px=budget_ms)
        if acquired is None and self._redis_up():
            # Another gateway computes this answer right now: wait for it (or for its lock
            # to go away without an answer, then compute it here).
            while time.monotonic() < deadline:
                await asyncio.sleep(LOCK_POLL_S)
                entry = await self.get(key)
                if entry is not None and entry.fresh(time.time()):
                    self.stats.coalesced += 1
                    return entry.content, True
                if not await self._redis_call("exists", lock):
                    break
        elif acquired:
            # Looked up before a flight that has just ended wrote its answer: that answer
            # is here now (the lock is taken after the writer's put), so use it.
            entry = await self.get(key)
            if entry is not None and entry.fresh(time.time()):
                await self._redis_call("delete", lock)
                self.stats.coalesced += 1
                return entry.content, True
        self.stats.misses += 1
        try:
            body = await compute()
            await self.put(key, body, ttl_s, stale_s)
        finally:
            if acquired:
                await self._redis_call("delete", lock)
        return body, False

    # --- Redis, failing soft ---------------------------------------------------------------

    def _redis_up(self) -> bool:
        return self.redis is not None and time.monotonic() >= self._redis_down_until

    async def _redis_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if not self._redis_up():
            return None
        try:
            return await getattr(self.redis, method)(*args, **kwargs)
        except Exception as exc:  # any Redis trouble is a miss, never a failed request
            self.stats.errors += 1
            self._redis_down_until = time.monotonic() + 1.0  # don't pay a timeout per request
            log.warning("response cache: redis unavailable", error=f"{type(exc).__name__}: {exc}")
            return None

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()
