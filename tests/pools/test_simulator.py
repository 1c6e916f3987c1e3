"""Simulator: exact waits, cold and warm starts, conservation, replay equals simulation."""

from __future__ import annotations

import math

import numpy as np

from ember.costmodel import CostModel
from ember.pools import policies as pol
from ember.pools.autoscaler import (
    Autoscaler,
    EmberConfig,
    EmberState,
    PromotionTimes,
    decide,
)
from ember.pools.simulator import SimConfig, simulate
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
