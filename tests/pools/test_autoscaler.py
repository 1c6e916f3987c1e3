"""The predictive policy on a fake clock: lead, noise, stabilization, floors, panic."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import structlog

from ember.pools.autoscaler import (
    Autoscaler,
    Decision,
    EmberConfig,
    EmberState,
    TierCounts,
    decide,
    ember_autoscaler,
    release_hold,
)
from ember.registry.schemas import PoolPolicy
from tests.pools.conftest import CAP, obs

PER_HOT = CAP * 0.7  # units/s one hot replica carries at target utilization


def run(cfg: EmberConfig, demands: list[float], t0: float = 0.0, dt: float = 1.0,
        state: EmberState | None = None) -> list[Decision[EmberState]]:  # fmt: skip
    st = state or EmberState()
    out = []
    for i, d in enumerate(demands):
        dec = decide(obs(d, dt=dt), st, cfg, t0 + (i + 1) * dt)
        st = dec.state
        out.append(dec)
    return out


def test_config_takes_the_deployment_policy() -> None:
    cfg = EmberConfig.from_policy(PoolPolicy(min_hot=2, max_replicas=9, target_utilization=0.6))
    assert (cfg.min_hot, cfg.max_replicas, cfg.target_utilization) == (2, 9, 0.6)
    assert EmberConfig.from_policy(PoolPolicy(min_hot=0, scale_to_zero=True)).warm_floor == 1


def test_scales_up_lead_seconds_before_a_daily_ramp() -> None:
    # Two days of 8 u/s that steps to 40 u/s at 08:00; on day 3 the profile says so.
    cfg = EmberConfig(max_replicas=50, profile_periods_s=(86_400.0,))
    dt, step = 10.0, 8 * 3600.0
    ramp = 2 * 86_400 + step  # day 3, 08:00
    times = np.arange(dt, ramp - 40, dt)  # up to 08:00 minus 50 s
    demand = [40.0 if (t - dt) % 86_400 >= step else 8.0 for t in times]
    st = run(cfg, demand, dt=dt)[-1].state
    lead = 30.0  # no warm or standby replica in the observation: lead is a cold start
    before = decide(obs(8.0, dt=dt), st, cfg, ramp - 40)  # + lead = 08:00 minus 10 s
    at = decide(obs(8.0, dt=dt), before.state, cfg, ramp - lead)  # + lead = 08:00
    assert before.lead_s == at.lead_s == lead
    assert before.desired.hot == math.ceil(8.0 / PER_HOT)  # 8 / 5.6 -> 2
    assert at.desired.hot == math.ceil(40.0 / PER_HOT)  # 8 * (40 / 8) / 5.6 = 7.1 -> 8
    # The hot stage looks one cold start (+10 % and a tick) ahead: 30 * 1.1 + 1 = 34 s.
    assert "at +34s (hot, from cold in 30s)" in at.reasons[0]


def test_lead_is_the_promotion_time_of_the_source_tier() -> None:
    cfg = EmberConfig()
    assert decide(obs(1.0, warm=1), EmberState(), cfg, 1.0).lead_s == 2.0
    assert decide(obs(1.0, standby=1), EmberState(), cfg, 1.0).lead_s == 5.0
    assert decide(obs(1.0), EmberState(), cfg, 1.0).lead_s == 30.0


def test_no_flapping_on_noise() -> None:
    rng = np.random.default_rng(7)
    mean = 4.5 * PER_HOT  # 25.2 u/s -> 4.5 replicas: the ceiling is 5 either side of noise
    demand = (mean * rng.uniform(0.7, 1.3, 3600)).tolist()
    mean_only = EmberConfig(max_replicas=50, forecast_quantile=0.5)  # no spread margin
    hots = [d.desired.hot for d in run(mean_only, demand)]
    assert set(hots[600:]) == {5}


def test_scale_down_waits_for_stabilization_then_one_tier_at_a_time() -> None:
    cfg = EmberConfig(
        max_replicas=50,
        level_tau_s=60.0,
        stabilization_s=120.0,
        standby_keep_s=7_200.0,
        forecast_quantile=0.5,  # the mean: the windows alone, no spread margin
    )
    high, low = 9.5 * PER_HOT, 10.0  # 53.2 u/s -> 10 hot; 10 u/s -> 1.8 -> 2 hot
    t0 = 1800.0
    warm = run(cfg, [high] * int(t0))
    assert warm[-1].desired.hot == 10
    after = run(cfg, [low] * 8000, t0=t0, state=warm[-1].state)
    at = {i + 1: d.desired for i, d in enumerate(after)}  # seconds after the drop
    assert all(at[s].hot == 10 for s in range(1, int(cfg.stabilization_s)))
    # The level falls below 2 replicas' worth after 60 ln(43.2 / 1.2) = 215 s, then the
    # 120 s window must pass: hot is 2 from about 339 s on.
    assert at[400] == TierCounts(hot=2, warm=10 - 2, standby=0)  # demoted hot -> warm
    assert at[700].hot == 2 and at[700].standby > 0  # warm_keep_s: warm -> standby
    assert at[700].total == 10  # nothing cold yet
    assert at[7400].total < 10  # after standby_keep_s: standby -> cold


def test_floor_and_cap() -> None:
    assert decide(obs(0.0), EmberState(), EmberConfig(min_hot=2), 100.0).desired.hot == 2
    capped = decide(obs(1000.0, queued=500), EmberState(), EmberConfig(max_replicas=4), 1.0)
    assert capped.desired == TierCounts(hot=4, warm=0, standby=0)


def test_scale_to_warm_not_to_zero() -> None:
    cfg = EmberConfig(min_hot=0, scale_to_zero=True)
    busy = run(cfg, [3.0] * 60)
    assert busy[-1].desired.hot == 1
    idle = run(cfg, [0.0] * 40, t0=60.0, state=busy[-1].state)
    assert idle[int(cfg.idle_hold_s) - 2].desired.hot == 1
    assert idle[-1].desired == TierCounts(hot=0, warm=1, standby=0)
    assert any("idle" in r for r in idle[-1].reasons)


def test_panic_when_the_queue_outgrows_capacity() -> None:
    cfg = EmberConfig(max_replicas=100)
    steady = run(cfg, [2 * PER_HOT] * 300)  # 2 hot
    st = steady[-1].state
    # 40 u/s arrive at 2 replicas (16 u/s): the queue grows past 1 s of hot capacity.
    first = decide(obs(40.0, hot=2, queued=10.0), st, cfg, 301.0)
    second = decide(obs(40.0, hot=2, queued=40.0), first.state, cfg, 302.0)
    assert any(r.startswith("panic") for r in second.reasons)
    # Panic sizes for demand plus draining the queue at full utilization, within the
    # drain time or a tenth of the time capacity takes to come (no warm or standby
    # replica ready: a cold start, 30 s -> 3 s):
    drain_s = max(cfg.drain_s, cfg.drain_per_promotion * 30.0)
    assert second.desired.hot >= math.ceil((40.0 + 40.0 / drain_s) / CAP)  # 53.3 / 8 -> 7
    # and never scales down while it lasts, even when demand falls back.
    calm = decide(obs(0.0, hot=7, queued=0.0), second.state, cfg, 303.0)
    assert calm.desired.hot >= 7


def test_wrapper_keeps_state_logs_with_model_and_version() -> None:
    now = [0.0]
    scaler = ember_autoscaler(EmberConfig(), clock=lambda: now[0], model="m", version="3")
    merge = [structlog.contextvars.merge_contextvars]
    with structlog.testing.capture_logs(processors=merge) as logs:
        for i in range(3):
            now[0] = float(i + 1)
            scaler.step(obs(2.0))
    assert scaler.state.last_t == 3.0
    assert logs[0]["model"] == "m" and logs[0]["version"] == "3"
    assert logs[0]["reasons"] and "desired_hot" in logs[0] and "arrived_units_per_s" in logs[0]


def test_autoscaler_is_generic_over_policies() -> None:
    def fixed(o: object, s: int, c: int, now: float) -> Decision[int]:
        return Decision(TierCounts(hot=c), s + 1, ("fixed",))

    scaler: Autoscaler[int, int] = Autoscaler(fixed, 3, 0, clock=lambda: 0.0, log_decisions=False)
    assert scaler.step(obs(1.0)).desired.hot == 3 and scaler.state == 1


def test_a_queue_within_hot_headroom_adds_no_replica() -> None:
    cfg = EmberConfig(max_replicas=50, forecast_quantile=0.5)
    st = run(cfg, [10.0] * 900)[-1].state  # 10 u/s -> 10 / 5.6 -> 2 hot (16 u/s)
    small = decide(obs(10.0, hot=2, queued=4.0), st, cfg, 901.0)
    assert small.desired.hot == 2  # 6 u/s of headroom drains 4 units within drain_s
    big = decide(obs(10.0, hot=2, queued=30.0), st, cfg, 901.0)
    # No warm or standby replica is ready: capacity is a cold start (30 s) away, so the
    # queue drains within a tenth of it (3 s), not drain_s.
    drain_s = max(cfg.drain_s, cfg.drain_per_promotion * 30.0)
    assert big.desired.hot == math.ceil((10.0 + 30.0 / drain_s) / CAP)  # 20 / 8 -> 3
    assert any(r.startswith("queue") for r in big.reasons)


def test_async_backlog_drains_slowly_and_never_panics() -> None:
    cfg = EmberConfig(max_replicas=50)
    st = run(cfg, [10.0] * 900)[-1].state
    async_obs = replace(obs(10.0, hot=2), async_queued_units=600.0)
    dec = decide(async_obs, st, cfg, 901.0)
    # 600 units over async_drain_s (60 s) = 10 u/s on top of the 10 u/s forecast: 3 hot,
    # not the 75 that draining 600 units within drain_s would take.
    assert dec.desired.hot == math.ceil((10.0 + 600.0 / cfg.async_drain_s) / CAP)
    again = decide(replace(async_obs, async_queued_units=700.0), dec.state, cfg, 902.0)
    assert not any(r.startswith("panic") for r in again.reasons)


def test_warm_buffer_holds_the_largest_recent_tick() -> None:
    cfg = EmberConfig(max_replicas=50)
    quiet = run(cfg, [2.0] * 600)
    spares = TierCounts(hot=1, warm=cfg.warm_spares, standby=0)  # never saw a burst
    assert quiet[-1].desired == spares
    spike = run(cfg, [60.0], t0=600.0, state=quiet[-1].state)[-1]
    after = run(cfg, [2.0] * 300, t0=601.0, state=spike.state)
    # 60 u/s in one tick needs ceil(60 / 8) = 8 replicas at full utilization: whatever is
    # not hot waits warm, one promotion (warm_s) away, not a cold start away.
    for d in after[200:]:
        assert d.desired.hot + d.desired.warm >= math.ceil(60.0 * math.exp(-300 / 1800) / CAP)
    assert after[-1].desired.hot == 1
    assert any(r.startswith("surge") for r in after[-1].reasons)
    # ... and it is forgotten over surge_decay_s.
    gap = 6 * cfg.surge_decay_s
    later = decide(obs(2.0, dt=gap), after[-1].state, cfg, 901.0 + gap)
    assert later.desired == spares


def test_an_instant_activator_call_is_not_a_surge() -> None:
    # The activator decides at the first arrival: one request's units over ~0 s.
    cfg = EmberConfig(min_hot=0, scale_to_zero=True, max_replicas=50)
    first = decide(obs(3.0 / 1e-9, hot=0, warm=1, dt=1e-9), EmberState(), cfg, 10.0)
    assert first.desired.hot == 1
    # 3 units in one tick: one replica carries them; only the spares wait warm.
    assert first.desired.warm == cfg.warm_spares
    assert first.state.forecaster.surge == 3.0
    assert not any(r.startswith("surge") for r in first.reasons)


def test_scale_to_warm_then_standby_unless_used_at_this_time_of_day() -> None:
    cfg = EmberConfig(min_hot=0, scale_to_zero=True, max_replicas=10)
    # Used once, at t = 0..60 s; then idle.
    st = run(cfg, [3.0] * 60)[-1].state
    at = {
        t: decide(obs(0.0, hot=0, warm=1, dt=t - 60.0), st, cfg, t)
        for t in (60.0 + cfg.warm_keep_s - 10, 60.0 + cfg.warm_keep_s + 10)
    }
    assert at[60.0 + cfg.warm_keep_s - 10].desired == TierCounts(hot=0, warm=1, standby=0)
    late = at[60.0 + cfg.warm_keep_s + 10]
    assert late.desired == TierCounts(hot=0, warm=0, standby=1)
    assert any("standby floor" in r for r in late.reasons)


def test_predicted_use_keeps_the_warm_floor_through_an_idle_spell() -> None:
    cfg = EmberConfig(min_hot=0, scale_to_zero=True, max_replicas=10)
    day, nine = 86_400.0, 9 * 3600.0
    st = EmberState()
    for d in range(3):  # used 09:00-09:20 on three days, idle otherwise
        busy = run(cfg, [3.0] * 120, t0=d * day + nine, dt=10.0, state=st)
        st = busy[-1].state
        st = decide(obs(0.0, hot=0, warm=1, dt=600.0), st, cfg, d * day + nine + 1800).state
    # Day 4, 08:50 (idle for ~23 h): it is used at this time of day -> warm floor.
    before = decide(obs(0.0, hot=0, warm=1, dt=3600.0), st, cfg, 3 * day + nine - 600)
    assert before.desired == TierCounts(hot=0, warm=1, standby=0)
    # Day 4, 15:00: never used around then -> standby floor.
    off = decide(obs(0.0, hot=0, warm=1, dt=3600.0), st, cfg, 3 * day + 15 * 3600.0)
    assert off.desired == TierCounts(hot=0, warm=0, standby=1)


def test_the_burst_guard_follows_its_own_decay_not_the_stabilization_window() -> None:
    # 10 s at 60 u/s on a 2 u/s model: the burst guard (the short-window demand at full
    # utilization) adds hot replicas at once; after the burst they go as its envelope
    # decays (burst_decay_s), not held for stabilization_s on top of that decay. Sustained
    # demand (the forecast) is still held for the stabilization window. (The mean forecast:
    # a forecast quantile keeps more, for the spread the burst left, over level_tau_s.)
    cfg = EmberConfig(max_replicas=50, forecast_quantile=0.5)
    quiet = run(cfg, [2.0] * 600)
    burst = run(cfg, [60.0] * 10, t0=600.0, state=quiet[-1].state)
    after = run(cfg, [2.0] * 120, t0=610.0, state=burst[-1].state)
    assert burst[-1].desired.hot >= 5 and any("burst guard" in r for r in burst[-1].reasons)
    # 35 s after, not 60 -- plus the release hold: 5 warm promotions (2 s) = 10 s.
    assert after[44].desired.hot <= 2 < burst[-1].desired.hot
    assert after[-1].desired.hot == 1


def test_the_release_hold_follows_how_bursty_the_demand_is() -> None:
    # Dedicated GPUs, cold start 30 s. Demand the forecast tracks (20 u/s with a little
    # noise: burstiness ~0.1) holds its hot count for the stabilization window (60 s;
    # release_hold_smooth = 1 cold start is less), not release_hold cold starts (150 s):
    # the most the noise asked for in the last 150 s is hot time for nothing. Bursty
    # demand (60 u/s for 20 s a minute, burstiness ~1) keeps the long hold: there a
    # release is soon undone.
    dedicated = EmberConfig(max_replicas=50, warm_cost=1.0, standby_cost=1.0)
    fixed = replace(dedicated, release_hold_smooth=dedicated.release_hold)
    rng = np.random.default_rng(7)
    smooth = list(20.0 + rng.normal(0.0, 2.0, 3000))
    bursty = list(np.where(np.arange(3000) % 60 < 20, 60.0, 0.0))  # 20 s on, 40 s off

    def hot_seconds(cfg: EmberConfig, demand: list[float]) -> tuple[int, list[float]]:
        out = run(cfg, demand)[600:]
        return sum(d.desired.hot for d in out), [d.state.forecaster.burstiness for d in out]

    scaled, seen = hot_seconds(dedicated, smooth)
    assert max(seen) < dedicated.smooth_cv
    assert scaled < hot_seconds(fixed, smooth)[0]
    scaled, seen = hot_seconds(dedicated, bursty)
    assert min(seen) > dedicated.bursty_cv
    assert scaled == hot_seconds(fixed, bursty)[0]
    # In between, in proportion.
    fc = run(dedicated, smooth)[-1].state.forecaster
    middle = (dedicated.smooth_cv + dedicated.bursty_cv) / 2
    level = 10.0
    half = replace(fc, level=level, spread=(middle * level) ** 2)
    assert release_hold(half, dedicated) == pytest.approx(
        (dedicated.release_hold + dedicated.release_hold_smooth) / 2
    )


def test_capacity_is_held_for_as_long_as_bringing_it_back_costs() -> None:
    # Dedicated GPUs: warm and standby cost what hot does, so a released hot replica comes
    # back only by a cold start (30 s here). When arrivals stop, the busy replicas stay
    # hot for release_hold cold starts (5 x 30 = 150 s), not the idle hold (10 s): a
    # release the next request undoes is a cold start's misses.
    dedicated = EmberConfig(max_replicas=50, warm_cost=1.0, standby_cost=1.0)
    assert dedicated.below_hot.value == "cold"
    busy = run(dedicated, [20.0] * 600)
    hot = busy[-1].desired.hot
    assert hot >= 4
    quiet = run(dedicated, [0.0] * 200, t0=600.0, state=busy[-1].state)
    assert min(d.desired.hot for d in quiet[:140]) == hot  # held through 140 s of silence
    assert quiet[-1].desired.hot == 1  # then down to the floor
    assert any(r.startswith("idle") for r in quiet[-1].reasons)
    # Without the release hold the idle rule drops it 10 s after the last request.
    eager = replace(dedicated, release_hold=0.0)
    quiet = run(eager, [0.0] * 20, t0=600.0, state=run(eager, [20.0] * 600)[-1].state)
    assert quiet[-1].desired.hot == 1
    # Where warm is cheap it comes back in one warm promotion (2 s): the hold is 10 s.
    shared = EmberConfig(max_replicas=50)
    assert shared.below_hot.value == "warm"
    quiet = run(shared, [0.0] * 20, t0=600.0, state=run(shared, [20.0] * 600)[-1].state)
    assert quiet[-1].desired.hot == 1
