"""The control plane's per-key request rate limit, shared by every API process through Redis.

A generic cell rate algorithm (GCRA, the token bucket kept as one timestamp): each key has
a *theoretical arrival time* (TAT); a request is let through when the TAT is at most
``(burst - 1) / rate`` ahead of now, and moves it on by ``1 / rate``. One Redis key and one
atomic script call per request, on Redis's clock (API hosts' clocks may differ), for any
rate and burst (fractional ones too); a refusal says exactly when the next request fits
(``Retry-After``).

Why not the ``limits`` package: its windows count whole requests per whole seconds, which a
rate-with-burst (``2.5/s``, burst 7) maps onto only approximately; its Redis extra is
declared for redis-py below 8 (Ember runs 8) and the async one brings a second Redis
client (coredis). The script is the whole algorithm, and the event loop never waits on
anything but the one async call.

**Redis down or unset**: each API process limits on its own, in memory, with the same
rate and burst (N processes then let through up to N times the rate) until Redis answers
again, and says so in a warning (at most one every 10 s). Neither failing open (a flood
would be unlimited exactly while the platform is degraded) nor closed (an outage of the
limiter's store would stop the whole control plane, the admin's fixes too).
"""

from __future__ import annotations

import math
import time
from typing import Any

from ember.logs import get_logger
from ember.serving.cache import fast_redis

log = get_logger(__name__)
PREFIX = "ember:rate:"
REDIS_TIMEOUT_S = 0.1
DOWN_HOLD_S = 1.0
"""After a Redis error, limit locally this long before trying Redis again (no timeout paid
per request while it is away)."""
WARN_EVERY_S = 10.0
LOCAL_MAX_KEYS = 100_000

#: KEYS[1]: the key's TAT (ms, Redis clock). ARGV: emission interval (ms), tolerance (ms).
#: Returns 0 when allowed, else the milliseconds until the next request fits.
GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local interval = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local ahead = tat - now
if ahead > tolerance then
  return math.ceil(ahead - tolerance)
end
local new = tat + interval
redis.call('SET', KEYS[1], string.format('%.3f', new), 'PX', math.ceil(new - now) + 1000)
return 0
"""


def _parameters(rate: float, burst: float) -> tuple[float, float]:
    """Emission interval and tolerance (ms) of ``rate`` per second with ``burst``."""
    interval = 1000.0 / rate
    return interval, interval * (max(1.0, burst) - 1.0)


class LocalLimiter:
    """The same algorithm in one process's memory (Redis unset or away)."""

    def __init__(self) -> None:
        self.tat: dict[str, float] = {}

    def hit(self, key: str, rate: float, burst: float) -> float | None:
        interval, tolerance = _parameters(rate, burst)
        now = time.monotonic() * 1000.0
        tat = max(self.tat.get(key, now), now)
        if tat - now > tolerance:
            return (tat - now - tolerance) / 1000.0
        if len(self.tat) >= LOCAL_MAX_KEYS:  # drop the keys that are back to a full burst
            self.tat = {k: v for k, v in self.tat.items() if v > now}
        self.tat[key] = tat + interval
        return None


class RateLimiter:
    """``await hit(key, rate, burst)``: None when the request may go, else the seconds to
    wait. Never raises: Redis trouble falls back to ``LocalLimiter``."""

    def __init__(self, redis_url: str | None) -> None:
        self.redis: Any = None
        self.script: Any = None
        if redis_url:
            self.redis = fast_redis(redis_url, REDIS_TIMEOUT_S)
            self.script = self.redis.register_script(GCRA)
        self.local = LocalLimiter()
        self.down_until = 0.0
        self.warned_at = -math.inf

    @property
    def shared(self) -> bool:
        """Whether the limit is shared by every API process now (Redis up)."""
        return self.redis is not None and time.monotonic() >= self.down_until

    async def hit(self, key: str, rate: float, burst: float) -> float | None:
        if self.shared:
            interval, tolerance = _parameters(rate, burst)
            try:
                wait_ms = await self.script(
                    keys=[PREFIX + key], args=[f"{interval:.6f}", f"{tolerance:.6f}"]
                )
            except Exception as exc:  # any Redis trouble: limit locally for a while
                self.down_until = time.monotonic() + DOWN_HOLD_S
                self._warn(f"{type(exc).__name__}: {exc}")
            else:
                return None if int(wait_ms) <= 0 else int(wait_ms) / 1000.0
        elif self.redis is not None:
            self._warn("down")
        return self.local.hit(key, rate, burst)

    def _warn(self, error: str) -> None:
        now = time.monotonic()
        if now - self.warned_at >= WARN_EVERY_S:
            self.warned_at = now
            log.warning(
                "rate limit: redis unavailable, limiting in this process only",
                error=error[:200],
            )

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()
