"""The autoscaler's state survives a restart and a change of leader: the controller saves
it to Redis (``ForecastStore``) and whichever controller acts next restores it, so a
daily profile learned before is still there (here a compressed "day" of one hour)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest

from ember.domain.spec import Source
from ember.pools.autoscaler import (
    EmberConfig,
    EmberState,
    Observation,
    PromotionTimes,
    TierCounts,
    decide,
    state_from_dict,
    state_to_dict,
)
from ember.pools.controller import PoolsController
from ember.pools.demand import ForecastStore
from tests.pools.test_controller_autoscale import KEY, FakeBackend, view

DAY = 3600.0  # a compressed day: the profile's period is an hour, its bins a minute
KNOBS: dict[str, Any] = {"profile_periods_s": (DAY,), "profile_bin_s": 60.0}
STEP_AT = 1800.0  # 1 -> 40 u/s for ten minutes from the "day"'s half
T0 = 472_222 * DAY  # wall-clock seconds (the controller's autoscaler clock), a "midnight"
NEEDED = math.ceil(40.0 / (8.0 * 0.7))  # 8 u/s per replica at 0.7 -> 8


def observe(demand: float, have: TierCounts) -> Observation:
    # No warm or standby replica ready: the hot stage looks one cold start ahead.
    return Observation(1.0, demand, demand, 0.0, 0.0, 8.0, TierCounts(hot=have.hot),
                       promotion=PromotionTimes(2.0, 5.0, 30.0))  # fmt: skip


def demand_at(t: float) -> float:
    return 40.0 if STEP_AT <= (t - T0) % DAY < STEP_AT + 600 else 1.0


@pytest.fixture
def store(redis_url: str) -> ForecastStore:
    s = ForecastStore(redis_url.rsplit("/", 1)[0] + "/9", key="test:autoscaler")
    s.redis.delete(s.key)
    return s


def controller(store: ForecastStore | None) -> PoolsController:
    ctl = PoolsController(None, FakeBackend(), standby_pool=0, autoscale=KNOBS)  # type: ignore[arg-type]
    ctl.forecast_store = store
    ctl.deployments = {KEY: view(max_replicas=20)}
    return ctl


def learn(ctl: PoolsController, days: int) -> None:
    scaler = ctl.scaler(KEY, ctl.deployments[KEY], "1")
    scaler.log_decisions = False
    have = TierCounts(hot=1)
    for i in range(int(days * DAY)):
        t = T0 + i + 1.0
        have = scaler.step(observe(demand_at(t - 1.0), have), t).desired


def hot_ahead_of_the_step(ctl: PoolsController, day: int) -> int:
    """Hot wanted at the step minus the hot stage's horizon (30 s x 1.1 + 1 s = 34 s)."""
    scaler = ctl.scaler(KEY, ctl.deployments[KEY], "1")
    scaler.log_decisions = False
    t = T0 + day * DAY + STEP_AT - 34.0
    return scaler.step(observe(1.0, TierCounts(hot=1)), t).desired.hot


def test_the_state_round_trips_through_json() -> None:
    cfg = EmberConfig(**KNOBS)
    st = EmberState()
    for i in range(300):
        st = decide(observe(demand_at(T0 + i), TierCounts(hot=1)), st, cfg, T0 + i + 1).state
    data = json.loads(json.dumps(state_to_dict(st)))
    back = state_from_dict(data, cfg)
    assert back is not None
    assert json.dumps(state_to_dict(back)) == json.dumps(state_to_dict(st))  # NaN bins too
    # Another profile layout (other periods or bins) is not this state: start afresh.
    assert state_from_dict(data, EmberConfig()) is None
    assert state_from_dict({"format": 99}, cfg) is None
    assert state_from_dict({"format": 1, "forecaster": "x"}, cfg) is None


def test_a_learned_ramp_survives_a_restart_and_a_change_of_leader(store: ForecastStore) -> None:
    first = controller(store)
    learn(first, days=2)
    assert hot_ahead_of_the_step(first, day=2) >= NEEDED  # it learned the step
    asyncio.run(first._save_states(force=True))

    # A fresh controller without the store has learned nothing ...
    assert hot_ahead_of_the_step(controller(None), day=2) == 1
    # ... one that restores it (an API restart, or a new leader) is ready ahead.
    second = controller(store)
    asyncio.run(second._restore_states())
    assert hot_ahead_of_the_step(second, day=2) >= NEEDED

    # Losing the lease drops the autoscalers; acting again restores the stored state.
    second._abdicate()
    assert not second.scalers
    asyncio.run(second._restore_states())
    assert second.scalers[(KEY, "1")].state.forecaster.profiles


def test_the_autoscaler_view_is_json_with_stages_reasons_and_decisions() -> None:
    ctl = controller(None)
    learn(ctl, days=1)
    hot_ahead_of_the_step(ctl, day=1)
    out = ctl.autoscaler_of(KEY)
    json.dumps(out, allow_nan=False)  # no NaN or infinity on the wire
    assert out["version"] == "1" and out["acting"] is True
    assert [s["tier"] for s in out["forecast"]] == ["hot", "warm", "standby"]
    assert out["forecast"][0]["from"] == "cold" and out["forecast"][0]["horizon_s"] == 34.0
    assert out["desired"]["hot"] >= NEEDED and out["reasons"][0].startswith("forecast q0.8")
    assert len(out["decisions"]) == 20 and out["promotion_s"]["cold"] == 8.0
    assert controller(None).autoscaler_of((1, "nope"))["forecast"] == []


def test_the_cli_prints_each_stage_and_the_reasons() -> None:
    import ember.cli  # noqa: F401
    from ember.cli.deployments import autoscaler_text

    ctl = controller(None)
    learn(ctl, days=1)
    hot_ahead_of_the_step(ctl, day=1)
    text = autoscaler_text({"deployment": "m", **ctl.autoscaler_of(KEY)})
    assert "deployment m, production version 1" in text
    assert "promotion to hot (learned p95): warm 0.6 s, standby 2.5 s, cold 8.0 s" in text
    assert "  hot      covers" in text and "(from cold) -> " in text
    assert "desired: hot " in text and "  - forecast q0.8" in text
    empty = autoscaler_text({"deployment": "m", **controller(None).autoscaler_of(KEY)})
    assert "no decision yet" in empty


def test_a_changed_policy_applies_at_the_next_step_and_keeps_what_was_learned() -> None:
    ctl = controller(None)
    learn(ctl, days=1)
    before = ctl.scaler(KEY, ctl.deployments[KEY], "1")
    learned = before.state
    event = {"cron": "0 9 * * *", "min_hot": 4}
    ctl.deployments[KEY] = view(max_replicas=20, schedules=[event])
    after = ctl.scaler(KEY, ctl.deployments[KEY], "1")
    assert after is before and after.state is learned
    assert after.config.schedules[0].min_hot == 4


def test_a_deleted_deployment_takes_its_learned_state_with_it(store: ForecastStore) -> None:
    ctl = controller(store)
    learn(ctl, days=1)
    other = ((2, "other"), "7")  # saved by an earlier controller, deleted while none ran
    store.save({other: {"format": 1}})
    asyncio.run(ctl._save_states(force=True))
    assert store.load((KEY, "1")) is not None and store.load(other) is None

    ctl.deployments = {}  # deleted
    asyncio.run(ctl._save_states(force=True))
    assert store.load((KEY, "1")) is None and not ctl.scalers and not ctl.targets
    # Created again under the same name, it learns afresh.
    again = controller(store)
    asyncio.run(again._restore_states())
    assert hot_ahead_of_the_step(again, day=1) == 1


def test_learned_promotion_times_survive_a_restart(store: ForecastStore) -> None:
    first = controller(store)
    for seconds in (14.0, 16.0, 17.0):
        first.promotion.record(Source.cold, seconds)
    learn(first, days=0.01)
    asyncio.run(first._save_states(force=True))
    second = controller(store)
    asyncio.run(second._restore_states())
    assert second.promotion.samples[Source.cold] == [14.0, 16.0, 17.0]
    assert second.promotion.times().cold_s == 16.0
    store.redis.hset(store.key, store.PROMOTION_FIELD, '{"cold": ["x", -1, 1e9, 3]}')
    assert store.load_promotion() == {"cold": [3.0]}  # only what a promotion can take
    store.redis.hset(store.key, store.PROMOTION_FIELD, "not json")
    assert store.load_promotion() == {}


def test_a_compressed_day_shrinks_the_bins_and_memories_with_floors() -> None:
    from ember.config import Settings
    from ember.pools.scaling import COMPRESSED_WINDOWS, autoscale_knobs

    assert "profile_bin_s" not in autoscale_knobs(Settings())  # a real day: the defaults
    knobs = autoscale_knobs(Settings(scale_profile_period_s=60.0))
    cfg, defaults = EmberConfig(**knobs), EmberConfig()
    assert cfg.profile_periods_s == (60.0, 420.0)
    assert cfg.profile_bin_s == 2.0  # 60/144 s would be finer than two ticks
    for name in COMPRESSED_WINDOWS:  # 1/1440 of a day's: five ticks at least, never longer
        assert min(getattr(defaults, name), 5.0) <= getattr(cfg, name) <= getattr(defaults, name)
    assert cfg.burst_tau_s == defaults.burst_tau_s  # noise, not the day
    hour = EmberConfig(**autoscale_knobs(Settings(scale_profile_period_s=3600.0)))
    assert hour.stabilization_s == 5.0 and hour.level_tau_s == 7.5  # 180 s / 24
    assert EmberState().forecaster.update(1.0, 1.0, 0.0, cfg).activity.__len__() == 30
