"""What the dashboard plots: per deployment, a time series sampled by the acting pools
controller every ``every_s`` seconds (replicas by tier, the demand the autoscaler saw, its
forecast at each tier's horizon), kept ``keep_s`` with a bounded number of samples; and
per API process, a window of recent answers per version (latency, errors, ladder rungs).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.logs import get_logger

if TYPE_CHECKING:
    import redis

    from ember.pools.controller import PoolsController

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

    async def tick(self, controller: PoolsController) -> None:
        """Sample every deployment when one is due. Redis is written in a thread in the
        background, one write at a time: a slow Redis skips samples, it never holds up
        the controller."""
        now = time.monotonic()
        if now - self._last_sample < self.every_s:
            return
        self._last_sample = now
        if self._redis is None:
            self.store(self.sample(controller))
            return
        if self._writing is not None and not self._writing.done():
            return
        samples = self.sample(controller)
        if samples:
            self._writing = asyncio.get_running_loop().create_task(self._store_in_thread(samples))

    async def _store_in_thread(self, samples: dict[Key, dict[str, Any]]) -> None:
        try:
            await asyncio.to_thread(self.store, samples)
        except Exception as exc:  # Redis away: these samples are lost, not the controller
            log.warning("could not store the dashboard history", error=str(exc)[:200])

    def sample(
        self, controller: PoolsController, at: float | None = None
    ) -> dict[Key, dict[str, Any]]:
        """One sample per deployment: replicas by tier, the demand the autoscaler saw since
        the last sample (mean over its steps) and its latest forecast per tier."""
        at = time.time() if at is None else at
        standby = sum(1 for r in controller.replicas.values() if r.state == "standby")
        out: dict[Key, dict[str, Any]] = {}
        for key, view in controller.deployments.items():
            mine = [r for r in controller.replicas.values() if r.key == key]
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
            scaler = controller.scalers.get((key, version)) if version is not None else None
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


@dataclass
class _Answer:
    at: float
    latency_ms: float
    status: int
    rung: str | None


class RequestStats:
    """Recent answers per (tenant id, deployment, version), in this API process: the
    dashboard's latency p50 / p99, error rate and ladder rungs. Bounded: the last
    ``per_version`` answers of each version, and no more than ``max_versions`` versions."""

    def __init__(self, per_version: int = 4096, max_versions: int = 2048) -> None:
        self.per_version = per_version
        self.max_versions = max_versions
        self.answers: dict[tuple[int, str, str], deque[_Answer]] = {}
        self.first_answers: dict[tuple[int, str], dict[str, float]] = {}
        """Per deployment: when each replica sent its first answer (wall clock), the
        last stage of its cold start. The newest ``max_versions`` replicas."""

    def record(
        self,
        tenant_id: int,
        deployment: str,
        version: str,
        status: int,
        rung: str | None,
        latency_ms: float,
        replica: str | None = None,
    ) -> None:
        if replica and replica != "-" and status < 400 and rung in (None, "model"):
            first = self.first_answers.setdefault((tenant_id, deployment), {})
            if replica not in first:
                if len(first) >= self.max_versions:
                    first.pop(next(iter(first)))
                first[replica] = round(time.time(), 3)
        key = (tenant_id, deployment, version)
        window = self.answers.get(key)
        if window is None:
            if len(self.answers) >= self.max_versions:
                self.answers.clear()
            window = self.answers[key] = deque(maxlen=self.per_version)
        window.append(_Answer(time.monotonic(), latency_ms, status, rung))

    def summary(self, tenant_id: int, deployment: str, window_s: float = 300.0) -> dict[str, Any]:
        """Per version, over the last ``window_s``: answers, latency p50 / p99 (ms) of the
        answered ones, the share that failed (5xx), those shed (429), answers per rung."""
        since = time.monotonic() - window_s
        out: dict[str, Any] = {}
        for (t, d, version), window in list(self.answers.items()):
            if (t, d) != (tenant_id, deployment):
                continue
            recent = [a for a in window if a.at >= since]
            if not recent:
                continue
            ok = sorted(a.latency_ms for a in recent if a.status < 400)
            rungs: dict[str, int] = {}
            for a in recent:
                if a.rung is not None:
                    rungs[a.rung] = rungs.get(a.rung, 0) + 1
            out[version] = {
                "requests": len(recent),
                "p50_ms": _quantile(ok, 0.50),
                "p99_ms": _quantile(ok, 0.99),
                "error_rate": round(sum(1 for a in recent if a.status >= 500) / len(recent), 6),
                "shed_rate": round(sum(1 for a in recent if a.status == 429) / len(recent), 6),
                "rungs": rungs,
            }
        return out


def _quantile(xs: list[float], q: float) -> float | None:
    """The nearest-rank quantile of sorted ``xs`` (None for none)."""
    if not xs:
        return None
    return round(xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))], 3)
