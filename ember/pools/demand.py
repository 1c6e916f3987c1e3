"""Demand seen by every API process, summed for the one pools controller that acts.

With several API replicas (Kubernetes, a Lease electing one controller), each gateway sees
only its share of the requests. Followers push what they counted to one Redis hash every
tick; the leader drains it (read and delete in one transaction) and adds it to its own
count before each autoscaler step — so the autoscaler sizes for the whole traffic, not
for the leader's share.
"""

from __future__ import annotations

from typing import cast

import redis

DemandKey = tuple[tuple[int, str], str]
"""((tenant id, deployment), version)."""

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
                key = ((int(tenant), deployment), version)
                amount = float(value)
            except ValueError:  # not ours: ignore it rather than stop the controller
                continue
            out.setdefault(key, [0.0, 0.0])[0 if kind == "a" else 1] += amount
        return out

    def close(self) -> None:
        self.redis.close()
