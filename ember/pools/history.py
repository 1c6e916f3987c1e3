"""What the dashboard plots: per deployment, a time series sampled by the acting pools
controller every ``every_s`` seconds (replicas by tier, the demand the autoscaler saw, its
forecast at each tier's horizon), kept ``keep_s`` with a bounded number of samples. (The
recent answers per version are the serving side's: ``ember.serving.stats``.)

With ``EMBER_REDIS_URL`` the samples are in Redis (a sorted set per deployment, scored by
time: ``ember:history:<tenant id>:<deployment>``), so every API process answers with the
leader's samples; without it they are held in this process.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ember.logs import get_logger

if TYPE_CHECKING:
    from collections.abc import Mapping

    import redis

    from ember.domain.spec import DeploymentKey
    from ember.pools.autoscaler import Autoscaler, EmberConfig, EmberState
    from ember.pools.inventory import ReplicaInventory
    from ember.serving.routing import DeploymentView

    Scalers = Mapping[tuple[DeploymentKey, str], Autoscaler[EmberState, EmberConfig]]
    """The acting controller's autoscaler per (deployment, version)."""

log = get_logger(__name__)

Key = tuple[int, str]
"""(tenant id, deployment name)."""

PREFIX = "ember:history"
STARTING = ("starting", "promoting")


def redis_key(key: Key, prefix: str = PREFIX) -> str:
    return f"{prefix}:{key[0]}:{key[1]}"


def _num(x: float) -> float | None:
    """JSON has no NaN or infinity."""
    return round(x, 6) if math.isfinite(x) else None


class History:
    """The deployments' time series: ``tick`` (the controller, each reconcile) samples
    when one is due; ``series`` reads them (any API process)."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        every_s: float = 2.0,
        keep_s: float = 3 * 3600.0,
        prefix: str = PREFIX,
    ) -> None:
        self.every_s = every_s
        self.keep_s = keep_s
        self.max_samples = max(1, math.ceil(keep_s / every_s))
        self.prefix = prefix
        self.memory: dict[Key, deque[dict[str, Any]]] = {}
        self._redis: redis.Redis | None = None
        if redis_url:
            import redis as redis_lib

            self._redis = redis_lib.Redis.from_url(
                redis_url, socket_timeout=2.0, socket_connect_timeout=2.0
            )
        self._last_sample = -math.inf
        self._seen: dict[Key, float] = {}
        """The time of the last autoscaler decision a sample took, per deployment."""
        self._writing: asyncio.Task[None] | None = None

    # --- sampling (the acting controller) ---------------------------------------------------

    async def tick(
        self,
        deployments: Mapping[DeploymentKey, DeploymentView],
        replicas: ReplicaInventory,
        scalers: Scalers,
    ) -> None:
        """Sample every deployment when one is due (what the controller holds: the registry
        view, its replicas and its autoscalers). Redis is written in a thread in the
        background, one write at a time: a slow Redis skips samples, it never holds up
        the controller."""
        now = time.monotonic()
        if now - self._last_sample < self.every_s:
            return
        self._last_sample = now
        if self._redis is None:
            self.store(self.sample(deployments, replicas, scalers))
            return
        if self._writing is not None and not self._writing.done():
            return
        samples = self.sample(deployments, replicas, scalers)
        if samples:
            self._writing = asyncio.get_running_loop().create_task(self._store_in_thread(samples))

    async def _store_in_thread(self, samples: dict[Key, dict[str, Any]]) -> None:
        try:
            await asyncio.to_thread(self.store, samples)
        except Exception as exc:  # Redis away: these samples are lost, not the controller
            log.warning("could not store the dashboard history", error=str(exc)[:200])

    def sample(
        self,
        deployments: Mapping[DeploymentKey, DeploymentView],
        replicas: ReplicaInventory,
        scalers: Scalers,
        at: float | None = None,
    ) -> dict[Key, dict[str, Any]]:
        """One sample per deployment: replicas by tier, the demand the autoscaler saw since
        the last sample (mean over its steps) and its latest forecast per tier."""
        at = time.time() if at is None else at
        standby = len(replicas.standby_ready())
        out: dict[Key, dict[str, Any]] = {}
        for key, view in deployments.items():
            mine = replicas.of(key)
            tiers = {
                "hot": sum(1 for r in mine if r.state == "ready" and r.tier == "hot"),
                "warm": sum(1 for r in mine if r.state == "ready" and r.tier == "warm"),
                "standby": standby,
                "starting": sum(1 for r in mine if r.state in STARTING),
            }
            version = view.production
            sample: dict[str, Any] = {
                "t": round(at, 3),
                "version": version,
                "replicas": tiers,
                "arrived_units_per_s": None,
                "admitted_units_per_s": None,
                "forecast": [],
            }
            scaler = scalers.get((key, version)) if version is not None else None
            if scaler is not None and scaler.last:
                since = self._seen.get(key, -math.inf)
                steps = [(t, o) for t, o, _ in scaler.last if t > since]
                if steps:
                    self._seen[key] = steps[-1][0]
                    n = len(steps)
                    arrived = sum(o.arrived_units_per_s for _, o in steps) / n
                    admitted = sum(o.admitted_units_per_s for _, o in steps) / n
                    sample["arrived_units_per_s"] = _num(arrived)
                    sample["admitted_units_per_s"] = _num(admitted)
                _, _, last = scaler.last[-1]
                sample["forecast"] = [
                    {
                        "tier": s.tier.value,
                        "horizon_s": _num(s.horizon_s),
                        "units_per_s": _num(s.forecast_units_per_s),
                    }
                    for s in last.stages
                ]
            out[key] = sample
        return out

    def store(self, samples: dict[Key, dict[str, Any]]) -> None:
        """Keep one sample per deployment: in Redis (blocking: call it from a thread), else
        in this process."""
        if self._redis is not None:
            self._write(samples)
            return
        for key, sample in samples.items():
            self._add(key, sample)

    def _add(self, key: Key, sample: dict[str, Any]) -> None:
        series = self.memory.get(key)
        if series is None:
            series = self.memory[key] = deque(maxlen=self.max_samples)
        series.append(sample)
        horizon = sample["t"] - self.keep_s
        while series and series[0]["t"] < horizon:
            series.popleft()
        gone = [k for k in self.memory if k != key and self.memory[k] and
                self.memory[k][-1]["t"] < horizon]  # fmt: skip
        for k in gone:  # deployments deleted hours ago
            del self.memory[k]

    def _write(self, samples: dict[Key, dict[str, Any]]) -> None:
        assert self._redis is not None
        pipe = self._redis.pipeline(transaction=False)
        for key, sample in samples.items():
            name = redis_key(key, self.prefix)
            pipe.zadd(name, {json.dumps(sample, separators=(",", ":")): sample["t"]})
            pipe.zremrangebyscore(name, "-inf", sample["t"] - self.keep_s)
            pipe.zremrangebyrank(name, 0, -self.max_samples - 1)
            pipe.expire(name, math.ceil(self.keep_s))
        pipe.execute()

    # --- reading (any API process) ----------------------------------------------------------

    def series(self, key: Key, since: float | None = None) -> list[dict[str, Any]]:
        """The deployment's samples after ``since`` (wall-clock seconds), oldest first
        (blocking with Redis: call it from a thread)."""
        low = -math.inf if since is None else since
        if self._redis is None:
            samples = list(self.memory.get(key, ()))
            i = bisect.bisect_right([s["t"] for s in samples], low)
            return samples[i:]
        raw: list[bytes] = self._redis.zrangebyscore(  # type: ignore[assignment]
            redis_key(key, self.prefix), f"({low}", "+inf"
        )
        return [json.loads(r) for r in raw]

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
