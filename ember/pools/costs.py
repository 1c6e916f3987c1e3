"""Cost per successful answer: replica-seconds over 2xx answers, per deployment version,
the same figure whichever API process is asked.

Two counts, kept apart because they are seen in different places:

- **replica-seconds** per tier, counted once: by the pools controller that acts on the
  replicas (the Lease holder on a cluster; followers observe the same replicas and count
  nothing), from its replica inventory — each replica from its start (or its assignment,
  for a standby process given a version) to the last reconcile that saw it;
- **successes**: a version's replicas' 2xx answers, counted by every API process's
  gateway as it sends them (cache hits and the ladder's defaults, which take no replica
  time, are not counted; nor are refused or failed requests).

Both are buffered in memory and added, every ``FLUSH_S``, to Redis (``EMBER_REDIS_URL``)
in one transaction: a per-minute hash (kept ``MINUTE_TTL_S``), a per-hour hash (kept
``HOUR_TTL_S``) and a lifetime hash. A reader sums the buckets of a window in one
transaction too, so two API processes asked between the same two flushes answer the same
figure. Without Redis (one API process) the same buckets live in this process's memory.

Windows: ``5m`` and ``1h`` are the last 5 and 60 minute buckets, ``24h`` the last 24 hour
buckets — the current, partial bucket included in each; ``lifetime`` since the hashes
were first written.

Standby processes belong to no deployment while they wait. Their replica-seconds are
apportioned to the deployment versions by the starts they served (a standby process
assigned a version counts one start for that version): over each window, a version gets
``standby seconds * its starts / all starts``. Standby seconds in a window without a start
stay unapportioned (shown as such, never in a version's figure).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from ember.logs import get_logger

log = get_logger(__name__)

FLUSH_S = 1.0
"""How often each process adds what it counted to the shared hashes."""
PREFIX = "ember:cost"
MINUTE_TTL_S = 2 * 3600 + 120
HOUR_TTL_S = 25 * 3600 + 120
WINDOWS: dict[str, tuple[str, int]] = {"5m": ("m", 5), "1h": ("m", 60), "24h": ("h", 24)}
"""Window name -> (bucket kind, how many buckets, the current one included)."""
STANDBY_TIER = "standby"
_SEP = "\t"

VersionKey = tuple[int, str, str, str]
"""(tenant id, deployment, model, version)."""
SecondsKey = tuple[int, str, str, str, str]
"""(tenant id, deployment, model, version, tier); a standby process: (0, "", "-", "-",
"standby")."""


def _field(kind: str, key: tuple[Any, ...]) -> str:
    return _SEP.join((kind, *(str(part) for part in key)))


@dataclass
class Counts:
    """One window's counts (or the lifetime's)."""

    seconds: dict[SecondsKey, float] = field(default_factory=dict)
    successes: dict[VersionKey, float] = field(default_factory=dict)
    starts: dict[VersionKey, float] = field(default_factory=dict)
    """Starts served by a standby process, per version."""

    def add_field(self, name: str, value: float) -> None:
        parts = name.split(_SEP)
        try:
            if parts[0] == "s" and len(parts) == 6:
                key5 = (int(parts[1]), parts[2], parts[3], parts[4], parts[5])
                self.seconds[key5] = self.seconds.get(key5, 0.0) + value
                return
            if parts[0] in ("ok", "st") and len(parts) == 5:
                key4 = (int(parts[1]), parts[2], parts[3], parts[4])
                into = self.successes if parts[0] == "ok" else self.starts
                into[key4] = into.get(key4, 0.0) + value
        except ValueError:  # not ours: skip it rather than fail the answer
            return

    @property
    def standby_seconds(self) -> float:
        return sum(s for k, s in self.seconds.items() if k[4] == STANDBY_TIER and not k[1])

    def standby_share(self, key: VersionKey) -> float:
        """The standby seconds apportioned to ``key`` by the starts it was served."""
        starts = sum(self.starts.values())
        if starts <= 0:
            return 0.0
        return self.standby_seconds * self.starts.get(key, 0.0) / starts

    def version_seconds(self, key: VersionKey) -> dict[str, float]:
        """Replica-seconds of ``key`` per tier, and its standby share (``standby_share``)."""
        tiers: dict[str, float] = {}
        for (t, d, m, v, tier), s in self.seconds.items():
            if (t, d, m, v) == key:
                tiers[tier] = tiers.get(tier, 0.0) + s
        tiers["standby_share"] = self.standby_share(key)
        return tiers

    def per_success(self, key: VersionKey) -> float | None:
        """Replica-seconds (own tiers plus the standby share) per success; None without a
        success."""
        ok = self.successes.get(key, 0.0)
        if ok <= 0:
            return None
        return sum(self.version_seconds(key).values()) / ok

    def versions(self) -> set[VersionKey]:
        own = {(t, d, m, v) for (t, d, m, v, _tier) in self.seconds if d}
        return own | set(self.successes) | set(self.starts)


@dataclass
class Snapshot:
    windows: dict[str, Counts]
    lifetime: Counts

    def versions(self) -> set[VersionKey]:
        out = self.lifetime.versions()
        for counts in self.windows.values():
            out |= counts.versions()
        return out

    def of_deployment(self, tenant_id: int, deployment: str) -> dict[str, Any]:
        """``GET /v1/deployments/{name}/cost``: per version the figure per window and for
        the lifetime, and what it is made of (``breakdown``)."""
        versions: dict[str, Any] = {}
        for key in sorted(k for k in self.versions() if k[0] == tenant_id and k[1] == deployment):
            version = key[3]
            all_counts = {**self.windows, "lifetime": self.lifetime}
            versions[version] = {
                "model": key[2],
                "window": {w: self.windows[w].per_success(key) for w in WINDOWS},
                "lifetime": self.lifetime.per_success(key),
                "breakdown": {
                    name: {
                        "replica_seconds": counts.version_seconds(key),
                        "successes": int(counts.successes.get(key, 0.0)),
                        "standby_starts": int(counts.starts.get(key, 0.0)),
                    }
                    for name, counts in all_counts.items()
                },
            }
        return {
            "deployment": deployment,
            "unit": "replica-seconds per successful answer",
            "versions": versions,
        }


class CostLedger:
    """The shared counts (see the module docstring). ``add_*`` only touch memory (the
    gateway calls ``add_success`` per answer); a background thread flushes them."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        prefix: str = PREFIX,
        clock: Callable[[], float] = time.time,
        flush_s: float = FLUSH_S,
    ) -> None:
        self.prefix, self.clock, self.flush_s = prefix, clock, flush_s
        self.redis: Any = None
        if redis_url:
            import redis

            self.redis = redis.Redis.from_url(redis_url, socket_timeout=2.0)
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}
        self._memory: dict[str, dict[str, float]] = {}
        """Without Redis: hash name -> field -> value (the same layout)."""
        self._memory_expiry: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.flush_errors = 0

    # --- counting -----------------------------------------------------------------------

    def _add(self, name: str, amount: float) -> None:
        with self._lock:
            self._pending[name] = self._pending.get(name, 0.0) + amount

    def add_seconds(self, key: SecondsKey, seconds: float) -> None:
        if seconds > 0:
            self._add(_field("s", key), seconds)

    def add_success(self, key: VersionKey) -> None:
        self._add(_field("ok", key), 1.0)

    def add_standby_start(self, key: VersionKey) -> None:
        self._add(_field("st", key), 1.0)

    # --- the shared hashes ----------------------------------------------------------------

    def _names(self, now: float) -> tuple[str, str, str]:
        minute, hour = int(now // 60), int(now // 3600)
        return f"{self.prefix}:m:{minute}", f"{self.prefix}:h:{hour}", f"{self.prefix}:life"

    def flush(self) -> None:
        """Add what was counted since the last flush to the shared hashes (kept for the next
        flush if Redis does not answer)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        minute, hour, life = self._names(self.clock())
        try:
            if self.redis is None:
                self._flush_memory(pending, minute, hour, life)
                return
            pipe = self.redis.pipeline(transaction=True)
            for name, amount in pending.items():
                for bucket in (minute, hour, life):
                    pipe.hincrbyfloat(bucket, name, amount)
            pipe.expire(minute, MINUTE_TTL_S)
            pipe.expire(hour, HOUR_TTL_S)
            pipe.execute()
        except Exception as exc:  # Redis away: keep the counts for the next flush
            self.flush_errors += 1
            with self._lock:
                for name, amount in pending.items():
                    self._pending[name] = self._pending.get(name, 0.0) + amount
            log.warning("could not share the cost counts", error=str(exc))

    def _flush_memory(self, pending: dict[str, float], *buckets: str) -> None:
        now = self.clock()
        with self._lock:
            for bucket in buckets:
                into = self._memory.setdefault(bucket, {})
                for name, amount in pending.items():
                    into[name] = into.get(name, 0.0) + amount
            self._memory_expiry[buckets[0]] = now + MINUTE_TTL_S
            self._memory_expiry[buckets[1]] = now + HOUR_TTL_S
            for bucket in [b for b, t in self._memory_expiry.items() if t < now]:
                self._memory.pop(bucket, None)
                self._memory_expiry.pop(bucket, None)

    def snapshot(self) -> Snapshot:
        """Every window's counts and the lifetime's, read at one instant (one transaction)."""
        now = self.clock()
        minute, hour = int(now // 60), int(now // 3600)
        wanted: dict[str, list[str]] = {}
        for window, (kind, n) in WINDOWS.items():
            at = minute if kind == "m" else hour
            wanted[window] = [f"{self.prefix}:{kind}:{at - i}" for i in range(n)]
        names = sorted({b for buckets in wanted.values() for b in buckets})
        life = f"{self.prefix}:life"
        if self.redis is None:  # one process: what it counted so far is the whole count
            self.flush()
            with self._lock:
                raw = {b: dict(self._memory.get(b, {})) for b in [*names, life]}
        else:
            pipe = self.redis.pipeline(transaction=True)
            for name in [*names, life]:
                pipe.hgetall(name)
            results = cast(list[dict[bytes, bytes]], pipe.execute())
            raw = {
                name: {k.decode(): float(v) for k, v in result.items()}
                for name, result in zip([*names, life], results, strict=True)
            }
        windows = {}
        for window, buckets in wanted.items():
            counts = Counts()
            for bucket in buckets:
                for name, value in raw[bucket].items():
                    counts.add_field(name, value)
            windows[window] = counts
        lifetime = Counts()
        for name, value in raw[life].items():
            lifetime.add_field(name, value)
        return Snapshot(windows, lifetime)

    # --- the flushing thread --------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ember-costs", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self.flush()
        if self.redis is not None:
            self.redis.close()
