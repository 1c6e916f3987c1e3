"""Routing: which replica serves a request.

Among READY replicas of the chosen version, the least in-flight model units wins. With a
session key, consistent hashing with bounded load keeps a key on one replica until that
replica carries more than ``load_bound`` x the average (then the key walks the ring).
Replicas that fail repeatedly are ejected for a while (circuit breaker). Retries of
failed requests and hedges draw from a retry budget (at most ~10 % of requests), so retries
cannot multiply an outage; hedges cannot spend its reserve.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ember.errors import CapacityError

EJECT_AFTER_FAILURES = 3
EJECT_FOR_S = 10.0


@dataclass(eq=False)
class Route:
    """What the router knows of one routable replica."""

    replica_id: str
    url: str
    version: str
    inflight_units: float = 0.0
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    secret: str = field(default="", repr=False, compare=False)
    """The replica API's secret (``ReplicaHandle.secret``): every hop sends it."""

    def routable(self, now: float) -> bool:
        return now >= self.ejected_until


def pick_version(traffic: dict[str, int], rng: random.Random) -> str:
    """A version by traffic weight (canary)."""
    versions = sorted(traffic)
    total = sum(traffic[v] for v in versions)
    if total <= 0:
        raise CapacityError("the deployment routes no traffic")
    point = rng.uniform(0, total)
    for version in versions:
        point -= traffic[version]
        if point <= 0:
            return version
    return versions[-1]


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def pick_replica(
    routes: Sequence[Route], session_key: str | None = None, load_bound: float = 1.25
) -> Route:
    now = time.monotonic()
    live = [r for r in routes if r.routable(now)] or list(routes)  # all ejected: try anyway
    if not live:
        raise CapacityError("no ready replica")
    if session_key is None or len(live) == 1:
        return min(live, key=lambda r: (r.inflight_units, r.replica_id))
    # Consistent hashing with bounded loads: walk the ring from the key's point and take
    # the first replica not above load_bound x the average in-flight units (+1 request).
    ring = sorted((_hash(f"{r.replica_id}#{i}"), r) for r in live for i in range(16))
    points = [p for p, _ in ring]
    average = sum(r.inflight_units for r in live) / len(live)
    cap = load_bound * (average + 1)
    start = bisect.bisect(points, _hash(session_key)) % len(ring)
    for i in range(len(ring)):
        candidate = ring[(start + i) % len(ring)][1]
        if candidate.inflight_units + 1 <= cap:
            return candidate
    return min(live, key=lambda r: r.inflight_units)


@dataclass
class RetryBudget:
    """Finagle-style: each request deposits ``ratio`` of a retry, each retry withdraws one;
    a small reserve lets a quiet service retry at all.

    A hedge (a speculative copy of a request that is merely slow) spends only what requests
    earned above the reserve: a run of slow answers cannot use up the retries that a request
    whose replica died needs (a hedged stuck replica, killed by its health probes, fails the
    request it still holds; that request is retried from the reserve)."""

    ratio: float = 0.1
    reserve: float = 3.0
    balance: float = field(default=3.0)

    def deposit(self) -> None:
        self.balance = min(self.balance + self.ratio, self.reserve + 100 * self.ratio)

    def try_withdraw(self, *, hedge: bool = False) -> bool:
        floor = self.reserve if hedge else 0.0
        if self.balance - 1.0 >= floor - 1e-9:  # deposits of 0.1 do not sum exactly
            self.balance -= 1.0
            return True
        return False


def record_failure(route: Route) -> None:
    route.consecutive_failures += 1
    if route.consecutive_failures >= EJECT_AFTER_FAILURES:
        route.ejected_until = time.monotonic() + EJECT_FOR_S


def record_success(route: Route) -> None:
    route.consecutive_failures = 0
    route.ejected_until = 0.0
