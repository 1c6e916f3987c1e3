"""Helpers for the pools tests: observations on a fake clock."""

from __future__ import annotations

from ember.pools.autoscaler import Observation, PromotionTimes, TierCounts

CAP = 8.0  # units/s per hot replica


def obs(
    demand: float,
    *,
    hot: int = 1,
    warm: int = 0,
    standby: int = 0,
    queued: float = 0.0,
    promoting: int = 0,
    dt: float = 1.0,
) -> Observation:
    return Observation(
        interval_s=dt,
        arrived_units_per_s=demand,
        admitted_units_per_s=demand,
        inflight_units=0.0,
        queued_units=queued,
        capacity_units_per_s=CAP,
        ready=TierCounts(hot, warm, standby),
        promoting=promoting,
        promotion=PromotionTimes(warm_s=2.0, standby_s=5.0, cold_s=30.0),
        inflight_requests=demand,
        queued_requests=queued,
    )
