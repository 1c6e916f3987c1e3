"""What the pools controller learns while it runs, each learner one small object.

- :class:`PromotionLearner`: seconds to serving per :class:`~ember.domain.spec.Source`
  (warm, standby, cold), the last 50 of each; the autoscaler plans with their p95
  (``PromotionTimes``), and they are saved with the autoscalers' state for the next
  controller.
- :class:`StandbySizer`: the shared standby pool's size, grown from the starts that asked
  it for a process with the simulator's own rule (``size_standby_pool``), the refill time
  learned from how long standby processes took to be ready.

Both are pure (no I/O, the clock passed in), so the reconcile loop reads as "observe,
learn, decide, act" and each learner is tested on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ember.domain.spec import Source
from ember.pools.autoscaler import (
    PromotionTimes,
    StandbyPoolConfig,
    StandbyPoolState,
    size_standby_pool,
)
from ember.pools.plan import standby_pool_size

KEEP = 50
"""Samples kept per series: recent enough to follow a change of host, enough for a p95."""


def _p95(xs: list[float]) -> float | None:
    ordered = sorted(xs)
    return ordered[int(0.95 * (len(ordered) - 1))] if ordered else None


@dataclass
class PromotionLearner:
    samples: dict[Source, list[float]] = field(
        default_factory=lambda: {source: [] for source in Source}
    )

    def record(self, source: Source, seconds: float) -> None:
        self.samples[source] = [*self.samples[source][-(KEEP - 1) :], seconds]

    def restore(self, stored: Mapping[Source, list[float]]) -> None:
        """What an earlier controller learned, before what is measured here."""
        for source, xs in stored.items():
            self.samples[source] = [*xs, *self.samples[source]][-KEEP:]

    def times(self) -> PromotionTimes:
        """p95 of what each source took here; one not yet measured keeps the default (the
        measured figures of ``bench/coldstart.py``), never above the next slower one."""
        default = PromotionTimes()

        def p95(source: Source, otherwise: float) -> float:
            measured = _p95(self.samples[source])
            return otherwise if measured is None else measured

        cold = p95(Source.cold, default.cold_s)
        standby = p95(Source.standby, min(default.standby_s, cold))
        return PromotionTimes(p95(Source.warm, min(default.warm_s, standby)), standby, cold)


@dataclass(frozen=True)
class Growth:
    """The standby pool grew: its new size, the most asks seen within one refill time,
    and that refill time."""

    size: int
    peak_asks: int
    refill_s: float


class StandbySizer:
    """The shared standby pool's size, within ``[floor, maximum]`` (a floor of 0: no pool)."""

    def __init__(self, floor: int, maximum: int | None = None) -> None:
        self.floor = floor
        self.maximum = floor if maximum is None else maximum
        self.size = floor
        """Standby processes kept now: the floor, grown by ``asked``."""
        self.state = StandbyPoolState()
        self.spawn_s: list[float] = []
        """Seconds a standby process took to be ready (the last 50): the refill time."""

    def spawned(self, seconds: float) -> None:
        self.spawn_s = [*self.spawn_s[-(KEEP - 1) :], seconds]

    def asked(self, now: float) -> Growth | None:
        """A start asked the pool for a process, found or not: the size from those asks
        (one more than the most asked for within one refill time), capped at the maximum;
        the growth, if it grew. A fixed pool (no maximum above the floor) never grows."""
        if self.maximum <= self.floor or self.floor == 0:
            return None
        refill = _p95(self.spawn_s)
        cfg = StandbyPoolConfig(minimum=self.floor)
        if refill is not None:
            cfg = StandbyPoolConfig(replenish_s=refill, minimum=self.floor)
        size, self.state = size_standby_pool(self.state, cfg, now)
        size = min(self.maximum, size)
        if size <= self.size:
            return None
        self.size = size
        return Growth(size, self.state.peak, cfg.replenish_s)

    def wanted(self, autoscalers: int) -> int:
        """The pool's size (:func:`~ember.pools.plan.standby_pool_size`): what its asks
        sized it to, or the standby replicas the production versions' autoscalers want
        together (``autoscalers``), within the bounds; none when the pool is off."""
        if self.floor == 0:
            return 0
        return standby_pool_size(self.size, autoscalers, floor=self.floor, maximum=self.maximum)
