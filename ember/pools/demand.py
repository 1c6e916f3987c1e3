"""Demand seen by every API process, summed for the one pools controller that acts.

With several API replicas (Kubernetes, a Lease electing one controller), each gateway sees
only its share of the requests. Followers push what they counted to one Redis hash every
tick; the leader drains it (read and delete in one transaction) and adds it to its own
count before each autoscaler step — so the autoscaler sizes for the whole traffic, not
for the leader's share.
"""

from __future__ import annotations

import json
from typing import Any, cast

import redis

from ember.domain.spec import DeploymentKey, Source

DemandKey = tuple[DeploymentKey, str]
"""(deployment, version)."""

HASH = "ember:pools:demand"
_SEP = "\t"


class SharedDemand:
    def __init__(self, redis_url: str, key: str = HASH) -> None:
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=2.0)
        self.key = key

    def push(self, demand: dict[DemandKey, list[float]]) -> None:
        """Add ``{key: [arrived units, admitted units]}`` to the shared count."""
        if not demand:
            return
        pipe = self.redis.pipeline(transaction=False)
        for ((tenant, deployment), version), (arrived, admitted) in demand.items():
            field = _SEP.join((str(tenant), deployment, version))
            pipe.hincrbyfloat(self.key, field + _SEP + "a", arrived)
            pipe.hincrbyfloat(self.key, field + _SEP + "d", admitted)
        pipe.execute()

    def drain(self) -> dict[DemandKey, list[float]]:
        """Everything pushed since the last drain (and forget it)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self.key)
        pipe.delete(self.key)
        raw = cast(dict[bytes, bytes], pipe.execute()[0])
        out: dict[DemandKey, list[float]] = {}
        for field, value in raw.items():
            try:
                tenant, deployment, version, kind = field.decode().split(_SEP)
                key = (DeploymentKey(int(tenant), deployment), version)
                amount = float(value)
            except ValueError:  # not ours: ignore it rather than stop the controller
                continue
            out.setdefault(key, [0.0, 0.0])[0 if kind == "a" else 1] += amount
        return out

    def close(self) -> None:
        self.redis.close()


STATE_HASH = "ember:pools:autoscaler"


class ForecastStore:
    """The autoscalers' state (forecaster and windows, ``state_to_dict``) in one Redis hash,
    field ``tenant \\t deployment \\t version``: saved by the acting controller every few
    seconds, read by whichever controller acts next (after a restart or a change of
    leader), so a learned daily profile is not lost with the process."""

    def __init__(self, redis_url: str, key: str = STATE_HASH) -> None:
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=2.0)
        self.key = key

    @staticmethod
    def _field(key: DemandKey) -> str:
        (tenant, deployment), version = key
        return _SEP.join((str(tenant), deployment, version))

    PROMOTION_FIELD = "promotion_s"
    """The promotion times the controller learned (per tier, the last samples): a new
    controller stages its tiers by them from its first tick, not by the defaults."""

    def save(
        self,
        states: dict[DemandKey, dict[str, Any]],
        promotion_s: dict[Source, list[float]] | None = None,
    ) -> None:
        mapping: dict[Any, Any] = {self._field(k): json.dumps(v) for k, v in states.items()}
        if promotion_s is not None and any(promotion_s.values()):
            mapping[self.PROMOTION_FIELD] = json.dumps(promotion_s)
        if mapping:
            self.redis.hset(self.key, mapping=mapping)

    def load_promotion(self) -> dict[Source, list[float]]:
        """The stored promotion samples per tier (finite, positive, at most 50 each);
        empty when none or not readable."""
        raw = cast(bytes | None, self.redis.hget(self.key, self.PROMOTION_FIELD))
        try:
            data = json.loads(raw) if raw is not None else {}
        except ValueError:
            return {}
        if not isinstance(data, dict):
            return {}
        out: dict[Source, list[float]] = {}
        for tier in Source:
            xs = data.get(tier)
            if isinstance(xs, list):
                ok = [float(x) for x in xs[-50:] if isinstance(x, int | float)]
                out[tier] = [x for x in ok if 0 < x < 86_400]
        return out

    def load(self, key: DemandKey) -> dict[str, Any] | None:
        """The stored state, or ``None`` (none stored, or not readable JSON)."""
        raw = cast(bytes | None, self.redis.hget(self.key, self._field(key)))
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def forget(self, key: DemandKey) -> None:
        self.redis.hdel(self.key, self._field(key))

    def keep_only(self, keys: set[DemandKey]) -> int:
        """Remove the state of every version not in ``keys`` (a deployment deleted, a
        version removed from it, while this controller ran or not); returns how many."""
        keep = {self._field(k) for k in keys} | {self.PROMOTION_FIELD}
        fields = cast(list[bytes], self.redis.hkeys(self.key))
        gone = [f for f in fields if f.decode("utf-8", "replace") not in keep]
        if gone:
            self.redis.hdel(self.key, *gone)
        return len(gone)

    def close(self) -> None:
        self.redis.close()
