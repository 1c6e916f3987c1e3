"""Simulator: exact waits, cold and warm starts, conservation, replay equals simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ember.costmodel import CostModel
from ember.pools import policies as pol
from ember.pools.autoscaler import (
    Autoscaler,
    EmberConfig,
    EmberState,
    PromotionTimes,
    TierCounts,
    decide,
)
from ember.pools.simulator import (
    SimConfig,
    SimResult,
    TierCost,
    _Pool,
    catalogue,
    shared_standby_pool,
    simulate,
)
from ember.pools.traces import Trace, synthetic

ONE_UNIT = CostModel(alpha=0.0, beta=0.0, gamma=1.0, capacity_units_per_s=1.0)
SIM = SimConfig(cost_model=ONE_UNIT, warmup_s=0.0, promotion=PromotionTimes(2.0, 5.0, 30.0))


def trace(times: list[float], duration: float) -> Trace:
    n = len(times)
    return Trace("t", np.asarray(times, dtype=float), np.zeros(n), np.zeros(n), duration)


def scaler(policy: object, cfg: object, state: object) -> Autoscaler[object, object]:
    return Autoscaler(policy, cfg, state, clock=lambda: 0.0, log_decisions=False)  # type: ignore[arg-type]


def test_fifo_waits_on_one_replica() -> None:
    # Three 1-unit requests at t=10 on one replica of 1 unit/s: they start at 10, 11, 12.
    res = simulate(
        trace([10.0, 10.0, 10.0], 60.0), scaler(pol.static, pol.StaticConfig(1), None), SIM
    )
    assert np.allclose(res.wait_s, [0.0, 1.0, 2.0])
    assert res.replica_s["hot"] == 60.0  # one replica for the whole trace
    assert res.summary()["over_slo_pct"] == 0.0  # 2.0 <= SLO 2 s


def test_knative_scale_from_zero_waits_a_cold_start() -> None:
    # Knative idles to zero after 60 s stable window + 30 s grace; a request at t=500
    # waits the whole cold start (30 s) and counts as a cold-start wait.
    kn = scaler(pol.knative, pol.KnativeConfig(), pol.KnativeState())
    res = simulate(trace([5.0, 500.0], 700.0), kn, SIM)
    assert math.isclose(res.wait_s[1], 30.0, abs_tol=1e-6)
    assert res.cold_wait.tolist() == [True, True]
    # hot (promoting counts) from the request until 60 s window + 30 s grace after it, twice
    assert math.isclose(res.replica_s["hot"], (5 + 90 - 5) + (500 + 90 - 500), abs_tol=1e-6)


def test_ember_scales_to_warm_and_pays_one_warm_promotion() -> None:
    cfg = EmberConfig(min_hot=0, scale_to_zero=True)
    res = simulate(trace([5.0, 500.0], 700.0), scaler(decide, cfg, EmberState()), SIM)
    assert math.isclose(res.wait_s[1], 2.0, abs_tol=1e-6)  # warm -> hot
    assert res.replica_s["warm"] > 600  # a warm replica is kept (at 0.1 the cost)


def test_every_request_is_served_or_shed_exactly_once() -> None:
    # Overload (a burst far beyond max_replicas) forces shedding.
    tr = synthetic(3, 1800.0, 3.0, period_s=600.0, bursts=2, burst_factor=8.0)
    cfg = EmberConfig(max_replicas=3)
    sim = SimConfig(cost_model=ONE_UNIT, warmup_s=0.0, max_wait_s=5.0)
    res = simulate(tr, scaler(decide, cfg, EmberState()), sim)
    served = ~np.isnan(res.wait_s)
    assert res.shed.any() and served.any()
    assert np.array_equal(served, ~res.shed)  # each request has exactly one outcome
    assert int(served.sum()) + int(res.shed.sum()) == len(tr)
    # served work fits in the capacity that was hot (1 unit/s per hot replica-second)
    assert served.sum() <= res.replica_s["hot"] + 1e-6
    assert (res.wait_s[served] >= 0).all()


def test_replaying_recorded_observations_gives_the_same_decisions() -> None:
    tr = synthetic(5, 3600.0, 4.0, period_s=1200.0, bursts=2)
    cfg = EmberConfig(max_replicas=20)
    sim_scaler = Autoscaler(decide, cfg, EmberState(), clock=lambda: 0.0, log_decisions=False,
                            record=True)  # fmt: skip
    simulate(tr, sim_scaler, SimConfig(cost_model=ONE_UNIT))
    assert sim_scaler.history
    # The pools controller's path: same wrapper, fed the same observations at the same times.
    t = [0.0]
    controller = Autoscaler(decide, cfg, EmberState(), clock=lambda: t[0], log_decisions=False)
    for now, observation, decision in sim_scaler.history:
        t[0] = now
        assert controller.step(observation) == decision


EIGHT = CostModel(alpha=0.0, beta=0.0, gamma=1.0, capacity_units_per_s=8.0)
FAST = PromotionTimes(warm_s=0.6, standby_s=2.5, cold_s=8.0)


def test_a_burst_seen_before_is_met_by_warm_promotions() -> None:
    # 2 req/s of 1 unit (one replica at 8 u/s is plenty) and twice a burst of 80 requests
    # within one second (10 replicas' worth). The first finds the two warm spares; the
    # second finds the warm buffer the first one taught (hot + warm carry a tick like it),
    # promoted within one tick + 0.6 s.
    steady = np.arange(0.0, 1200.0, 0.5)
    burst = np.linspace(0.0, 0.9, 80)
    times = np.sort(np.concatenate([steady, 300.0 + burst, 900.0 + burst]))
    sim = SimConfig(cost_model=EIGHT, warmup_s=0.0, promotion=FAST)

    def waits(surge_s: float) -> tuple[float, float, float]:
        cfg = EmberConfig(max_replicas=20, surge_s=surge_s)
        res = simulate(trace(times.tolist(), 1200.0), scaler(decide, cfg, EmberState()), sim)
        first = res.wait_s[(times >= 300) & (times < 301)].max()
        second = res.wait_s[(times >= 900) & (times < 901)].max()
        return float(first), float(second), res.replica_s["hot"]

    first, second, hot_s = waits(EmberConfig().surge_s)
    assert second <= sim.slo_wait_s < first
    assert hot_s < 1.25 * 1200  # the burst capacity went back to warm; ~1 hot all along
    _, second_without, _ = waits(1e12)  # no warm buffer: the second burst waits as long
    assert second_without > sim.slo_wait_s


def test_pending_starts_are_cancelled_before_ready_replicas() -> None:
    pool = _Pool(FAST)
    pool.hot = 3
    pool.apply(TierCounts(hot=3, warm=2), now=0.0)  # two warm replicas start from cold
    assert [e[1:] for e in pool.creating] == [("warm", "cold"), ("warm", "cold")]
    pool.apply(TierCounts(hot=1, warm=2), now=1.0)  # two hot ones are demoted meanwhile
    assert (pool.hot, pool.warm, pool.standby, pool.creating) == (1, 2, 0, [])


def test_a_catalogue_shares_one_standby_pool() -> None:
    # Scale-to-warm models that idle into the standby floor, then wake: each wake-up puts
    # one standby process to use. Apart, one shared process serves them all; together,
    # the pool must hold one per model waking within the replenish time.
    sim = SimConfig(cost_model=EIGHT, warmup_s=0.0, promotion=FAST)
    cfg = EmberConfig(min_hot=0, scale_to_zero=True, max_replicas=4)

    def model(wake: float) -> SimResult:
        return simulate(trace([1.0, wake], 4000.0), scaler(decide, cfg, EmberState()), sim)

    apart = [model(2000.0), model(3000.0)]
    together = [model(2000.0), model(2001.0), model(2003.0)]
    for r in apart + together:
        assert len(r.standby_takes_s) == 1  # the wake-up, from the standby floor
        assert r.wait_s[1] == pytest.approx(FAST.standby_s)  # a standby load, not a cold start
        assert r.replica_s["standby"] > 0  # charged per model...
    replenish = FAST.cold_s - FAST.standby_s
    assert shared_standby_pool(apart, replenish) == 1
    assert shared_standby_pool(together, replenish) == 3
    cat, pool = catalogue(apart, "ember", TierCost(), replenish_s=replenish)
    assert pool == 1
    assert cat.replica_s["standby"] == pytest.approx(4000.0)  # ... but one pool for both
    assert cat.replica_s["hot"] == sum(r.replica_s["hot"] for r in apart)
    tc = TierCost()
    assert cat.weighted_cost == pytest.approx(
        tc.hot * cat.replica_s["hot"] + tc.warm * cat.replica_s["warm"] + tc.standby * 4000.0
    )
    assert len(cat.wait_s) == 4
