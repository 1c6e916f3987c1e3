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
    StandbyPoolConfig,
    TierCounts,
    decide,
)
from ember.pools.simulator import (
    SharedStandby,
    SimConfig,
    TierCost,
    _Pool,
    catalogue,
    simulate,
    simulate_catalogue,
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


def test_ready_replicas_step_down_before_spares_still_loading_are_kept() -> None:
    # The pools controller's rules (ember.pools.plan): over the hot target, ready hot
    # replicas fill warm first and the warm spares still loading are cancelled; a hot
    # start on its way is not (the demand that asked for it may be back).
    sim = SimConfig(promotion=FAST)
    pool = _Pool(FAST)
    pool.hot = 3
    pool.apply(TierCounts(hot=3, warm=2), 0.0, sim)  # two warm replicas start from cold
    assert [e[1:] for e in pool.creating] == [("warm", "cold"), ("warm", "cold")]
    pool.apply(TierCounts(hot=1, warm=2), 1.0, sim)  # two hot ones are demoted meanwhile
    assert (pool.hot, pool.warm, pool.standby, pool.creating) == (1, 2, 0, [])
    pool.apply(TierCounts(hot=3, warm=0), 2.0, sim)  # two promotions, then demand goes
    pool.apply(TierCounts(hot=1, warm=0), 2.1, sim)
    assert (pool.hot, len(pool.promoting)) == (1, 2)  # on their way: not cancelled
    pool.complete(10.0)
    pool.apply(TierCounts(hot=1, warm=0), 10.0, sim)  # ready now: stopped
    assert (pool.hot, pool.warm, pool.promoting) == (1, 0, [])


def test_the_shared_standby_pool_learns_its_size_from_what_was_asked() -> None:
    pool = SharedStandby(StandbyPoolConfig(replenish_s=5.0))
    assert (pool.ready(0.0), pool.largest) == (1, 1)  # one process to start with
    assert pool.take(100.0)  # ready: taken, a replacement spawns (ready at 105)
    assert pool.ready(100.0) == 0 and pool.ready(105.0) == 2  # grew to 1 + margin 1
    assert pool.take(200.0) and pool.take(201.0)  # two within 5 s: both found one ...
    assert not pool.take(202.0)  # ... a third did not (it waits a cold start) ...
    assert pool.empty_s == [202.0] and pool.largest == 4  # ... and the pool grew to 3 + 1
    assert all(pool.take(300.0 + i) for i in range(3))  # the next such burst is served
    # Charged for what it held, ready or spawning: 1 until t=100, 2 until 201, 3, then 4.
    assert pool.held_s(0.0, 400.0) == pytest.approx(100 + 2 * 101 + 3 * 1 + 4 * 198)


def test_a_catalogue_shares_one_causally_sized_standby_pool() -> None:
    # Scale-to-zero models (no warm floor or spares, so a wake-up asks for one process)
    # that start from nothing three at a time, idle past their warm keep, then wake three
    # at a time. The pool starts with one process: the first round, one start finds it and
    # two wait a cold start, and the pool learns; the second round, each finds one.
    sim = SimConfig(cost_model=EIGHT, warmup_s=0.0, promotion=FAST)
    cfg = EmberConfig(min_hot=0, scale_to_zero=True, max_replicas=4, warm_spares=0,
                      warm_spare_fraction=0.0, min_warm=0)  # fmt: skip
    traces = [trace([1.0 + dt, 2000.0 + dt], 4000.0) for dt in (0.0, 1.0, 3.0)]
    scalers = [scaler(decide, cfg, EmberState()) for _ in traces]
    replenish = FAST.cold_s - FAST.standby_s
    results, pool = simulate_catalogue(
        traces, scalers, sim, standby=StandbyPoolConfig(replenish_s=replenish)
    )
    assert pool is not None
    first = [r.wait_s[0] for r in results]
    second = [r.wait_s[1] for r in results]
    assert first == pytest.approx([FAST.standby_s, FAST.cold_s, FAST.cold_s])
    assert second == pytest.approx([FAST.standby_s] * 3)
    assert pool.empty_s == [2.0, 4.0] and pool.largest == 4
    assert all(r.replica_s["standby"] == 0 for r in results)  # no standby of their own
    tc = TierCost()
    cat = catalogue(results, "ember", tc, pool)
    held = pool.held_s(0.0, 4000.0)
    assert cat.replica_s["standby"] == pytest.approx(held)
    assert held == pytest.approx(1 * 1 + 2 * 1 + 3 * 2 + 4 * (4000 - 4))  # grew at 1, 2, 4 s
    assert cat.weighted_cost == pytest.approx(
        tc.hot * cat.replica_s["hot"] + tc.warm * cat.replica_s["warm"] + tc.standby * held
    )
    assert len(cat.wait_s) == 6
    # Without a shared pool, the same models replay alone exactly as ``simulate`` does.
    alone, none = simulate_catalogue(traces[:1], [scaler(decide, cfg, EmberState())], sim)
    single = simulate(traces[0], scaler(decide, cfg, EmberState()), sim)
    assert none is None and np.array_equal(alone[0].wait_s, single.wait_s)
