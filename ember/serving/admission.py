"""Admission: per-tenant token buckets in model units, priority classes, deadlines.

A tenant's bucket refills at ``units_per_s`` up to ``burst``; a request that would
overdraw it is refused with 429 and the time until it would fit (``Retry-After``), so one
flooding tenant spends only its own budget. Async and batch traffic may only use what
online traffic leaves: they are refused while the gateway's queue is above a share of
capacity. If the predicted wait already exceeds the request's deadline, it is refused
now instead of timing out later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ember.domain.spec import Priority
from ember.errors import BackPressure

#: Share of the replicas' queue (in-flight units) each class may fill before it is refused:
#: online keeps at least 40 % of it to itself.
CLASS_CEILING = {Priority.online: 1.0, Priority.async_: 0.6, Priority.batch: 0.5}


def class_share(priority: Priority, queue: float) -> float:
    """What the class may hold of a queue of ``queue`` (units, or instances) at once."""
    return CLASS_CEILING.get(priority, 1.0) * queue


@dataclass
class TokenBucket:
    rate: float
    burst: float
    tokens: float = -1.0
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.burst

    def take(self, units: float, now: float | None = None) -> float:
        """0 if taken, else the seconds until ``units`` would be available."""
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if units <= self.tokens:
            self.tokens -= units
            return 0.0
        return (units - self.tokens) / self.rate if self.rate > 0 else float("inf")


class Admission:
    def __init__(self, units_per_s: float, burst_units: float) -> None:
        self.units_per_s = units_per_s
        self.burst_units = burst_units
        self.buckets: dict[str, TokenBucket] = {}

    def admit(
        self,
        tenant: str,
        units: float,
        priority: Priority,
        inflight_units: float,
        capacity_units: float,
        capacity_units_per_s: float,
        deadline_s: float,
        queue_units: float | None = None,
    ) -> None:
        """Raise ``BackPressure`` (429) unless the request may go now.

        ``capacity_units`` is what the replicas compute at once (a batch each);
        ``queue_units`` what they may hold queued and computing (default: the same). Async
        and batch traffic may fill their share of the latter, so a backlog keeps the
        replicas busy (a batch waiting behind the one computing) while online traffic keeps
        the rest of the queue."""
        ceiling = class_share(priority, queue_units or capacity_units)
        # An idle pool always takes one request of any class: else a small pool (one
        # replica, batch size 1) could never serve async or batch work at all.
        held = inflight_units > 0 and inflight_units + units > ceiling
        if priority is not Priority.online and held:
            raise BackPressure(
                f"{priority.label} traffic is held back while online traffic uses the capacity",
                retry_after_s=1.0, priority=priority.label,
            )  # fmt: skip
        predicted_wait = max(0.0, inflight_units - capacity_units) / max(capacity_units_per_s, 1e-9)
        if predicted_wait > deadline_s:
            raise BackPressure(
                f"predicted wait {predicted_wait:.2f}s exceeds the {deadline_s:.2f}s deadline",
                retry_after_s=max(1.0, predicted_wait), predicted_wait_s=round(predicted_wait, 3),
            )  # fmt: skip
        bucket = self.buckets.get(tenant)
        if bucket is None:
            bucket = self.buckets[tenant] = TokenBucket(self.units_per_s, self.burst_units)
        wait = bucket.take(units)
        if wait > 0:
            raise BackPressure(
                f"tenant {tenant!r} is over its budget of {self.units_per_s:g} model units/s",
                retry_after_s=max(1.0, wait), tenant=tenant,
            )  # fmt: skip
