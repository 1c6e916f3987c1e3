"""What this API process saw of its answers: the dashboard's recent latency, errors and
ladder rungs per version (the serving side records them; nothing is shared or persisted)."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any


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
