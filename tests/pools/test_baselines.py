"""The simulator's profiles and the baselines issue 22 adds (``ray@N``, ``oracle``,
``knative+cron``, ``ember@u``), and the step ramp replayed whole: Ember, having learned a
daily step, is ready before it; Knative and Ray are not."""

from __future__ import annotations

import math

import numpy as np

from ember.costmodel import CostModel
from ember.pools import policies as pol
from ember.pools.autoscaler import TierCounts
from ember.pools.replay import BENCH_COST_MODEL, Deployment, make_autoscaler
from ember.pools.simulator import PROFILES, SimConfig, simulate
from ember.pools.traces import daily_step, synthetic
from tests.pools.conftest import obs

HOUR = 3600.0


def sim(profile: str) -> SimConfig:
    p = PROFILES[profile]
    return SimConfig(cost_model=BENCH_COST_MODEL, promotion=p.promotion, tier_cost=p.tier_cost)


def test_profiles_set_promotion_times_and_tier_costs() -> None:
    cpu, shared, dedicated = PROFILES["cpu"], PROFILES["gpu-shared"], PROFILES["gpu-dedicated"]
    assert cpu.promotion.cold_s == 8.0 and shared.promotion.cold_s == 120.0
    assert shared.promotion == dedicated.promotion
    assert (shared.tier_cost.warm, shared.tier_cost.standby) == (0.1, 0.03)
    assert (dedicated.tier_cost.warm, dedicated.tier_cost.standby) == (1.0, 1.0)
    assert "warm 1, standby 1" in dedicated.describe()
    # Ember's policy is told the costs: under full charge it keeps no warm or standby buffer.
    tr = synthetic(0, 600.0, 1.0)
    dep = Deployment(1, 10)
    assert (
        make_autoscaler(
            "ember", tr, dep, BENCH_COST_MODEL, sim=sim("gpu-dedicated")
        ).config.uses_warm
        is False
    )
    assert make_autoscaler(
        "ember", tr, dep, BENCH_COST_MODEL, sim=sim("gpu-shared")
    ).config.uses_warm


def test_utilization_and_target_ongoing_settings() -> None:
    tr = synthetic(0, 600.0, 1.0)
    dep = Deployment(1, 10)
    assert make_autoscaler("ember@0.6", tr, dep, BENCH_COST_MODEL).config.target_utilization == 0.6
    assert (
        make_autoscaler("knative@0.9", tr, dep, BENCH_COST_MODEL).config.target_utilization == 0.9
    )
    assert make_autoscaler("ray@8", tr, dep, BENCH_COST_MODEL).config.target_ongoing_requests == 8
    assert make_autoscaler("ray", tr, dep, BENCH_COST_MODEL).config.target_ongoing_requests == 2


def test_the_oracle_starts_each_replica_one_cold_start_before_it_is_needed() -> None:
    # 8 u/s per replica, a 2 s SLO window: 32 units over ticks 5-6 need 16 u/s -> 2.
    units = [0.0] * 5 + [16.0, 16.0] + [0.0] * 5
    plan = pol.oracle_plan(units, 8.0, cold_s=3.0, slo_wait_s=2.0)
    # need per tick: 0 0 0 0 1 2 1 0 ... (each tick's window reaches 2 s ahead); each
    # replica started 3 ticks before its first needed tick, kept while needed within 3.
    assert plan.hot[:9] == (0, 1, 2, 2, 2, 2, 1, 0, 0)
    assert plan.next_change[0] == 1 and plan.next_change[2] == 6
    d = pol.oracle(obs(0.0), None, plan, 3.5)
    assert d.desired == TierCounts(hot=2) and d.next_eval_s == 6.0


def test_knative_cron_holds_the_scheduled_floor_from_one_cold_start_before_the_hour() -> None:
    floor = pol.cron_floor([0.0] * 9 + [40.0] + [0.0] * 14, 8.0, 0.7)
    assert floor[9] == math.ceil(40.0 / 5.6) and floor[8] == 0  # 40 / 5.6 -> 8
    cfg = pol.CronFloorConfig(pol.KnativeConfig(), floor, lead_s=120.0)
    st = pol.KnativeState()
    before = pol.knative_cron(obs(1.0), st, cfg, 9 * HOUR - 130)
    ahead = pol.knative_cron(obs(1.0), before.state, cfg, 9 * HOUR - 110)
    assert before.desired.hot == 1 and ahead.desired.hot == 8
    assert "cron floor 8" in ahead.reasons


def test_the_oracle_is_the_lower_bound_on_hot_capacity() -> None:
    cm = CostModel(alpha=0.0, beta=0.0, gamma=1.0, capacity_units_per_s=8.0)
    tr = synthetic(1, 2 * HOUR, 6.0, period_s=HOUR, bursts=2)
    cfg = SimConfig(cost_model=cm, promotion=PROFILES["gpu-dedicated"].promotion,
                    tier_cost=PROFILES["gpu-dedicated"].tier_cost)  # fmt: skip
    dep = Deployment(1, 50)
    runs = {p: simulate(tr, make_autoscaler(p, tr, dep, cm, sim=cfg), cfg).summary()
            for p in ("oracle", "static-peak", "knative")}  # fmt: skip
    assert runs["oracle"]["cold_wait_pct"] == 0.0
    assert runs["oracle"]["cost"] < runs["static-peak"]["cost"]
    assert runs["oracle"]["over_slo_pct"] <= runs["knative"]["over_slo_pct"]


def test_a_learned_daily_step_is_ready_before_it_and_the_peers_are_late() -> None:
    # A compressed "day" of two hours: 1 -> 40 req/s (one unit each) for 20 minutes from
    # its half, three days, gpu-dedicated (cold starts 120 s, every tier charged in full).
    day = 2 * HOUR
    tr = daily_step(3, 3, start_s=HOUR, end_s=HOUR + 1200, period_s=day)
    cfg = sim("gpu-dedicated")
    knobs = {"profile_periods_s": (day,), "profile_bin_s": 60.0}
    step = 2 * day + HOUR
    first = (tr.arrivals_s >= step) & (tr.arrivals_s < step + 600)
    over = {}
    for name in ("ember", "knative", "ray"):
        dep = Deployment(1, 50, ember=knobs)
        r = simulate(tr, make_autoscaler(name, tr, dep, BENCH_COST_MODEL, sim=cfg), cfg)
        over[name] = float(np.mean((r.wait_s[first] > 2.0 + 1e-6) | r.shed[first]))
    assert over["ember"] == 0.0  # no request of the step's first 10 minutes over the SLO
    assert over["knative"] > 0.01 and over["ray"] > 0.01
