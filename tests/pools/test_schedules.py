"""Scheduled capacity (``PoolPolicy.schedules``): validated like batch schedules, and each
floor applied ahead by the promotion time of the tier that fills it (fake clock)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from ember.pools.autoscaler import EmberConfig, EmberState, decide
from ember.registry.schemas import PoolPolicy
from tests.pools.conftest import obs

NINE = datetime(2026, 12, 2, 9, 0, tzinfo=UTC).timestamp()  # a Wednesday, winter
POLICY = PoolPolicy.model_validate(
    {
        "max_replicas": 20,
        "schedules": [
            {"cron": "0 9 * * *", "duration_s": 600, "min_hot": 6},
            {"cron": "0 9 * * *", "timezone": "Europe/Paris", "duration_s": 600, "min_warm": 4},
        ],
    }
)
CFG = EmberConfig.from_policy(POLICY)


def hot_at(t: float, **ready: int) -> int:
    return decide(obs(1.0, **ready), EmberState(), CFG, t).desired.hot


def test_schedules_are_validated_like_batch_schedules() -> None:
    for bad in ({"cron": "0 9 * *"}, {"cron": "61 9 * * *"}, {"cron": "0 9 * * *",
                "timezone": "Mars/Olympus"}, {"cron": "0 9 * * *", "timezone": "../etc"},
                {"cron": "0 9 * * *", "duration_s": 0}):  # fmt: skip
        with pytest.raises(ValidationError):
            PoolPolicy.model_validate({"schedules": [bad]})
    with pytest.raises(ValidationError, match="exceeds max_replicas"):
        PoolPolicy.model_validate(
            {"max_replicas": 4, "schedules": [{"cron": "0 9 * * *", "min_hot": 3, "min_warm": 2}]}
        )
    assert CFG.schedules[0].min_hot == 6 and CFG.schedules[1].timezone == "Europe/Paris"


def test_a_hot_floor_starts_one_cold_start_ahead_when_it_must_come_from_cold() -> None:
    # conftest promotion: warm 2 s, standby 5 s, cold 30 s; hot's horizon 30 x 1.1 + 1 = 34 s.
    assert hot_at(NINE - 40) == 1
    assert hot_at(NINE - 33) == 6
    assert hot_at(NINE + 300) == 6
    assert hot_at(NINE + 600) == 1  # the event lasted its 10 minutes


def test_a_hot_floor_that_warm_replicas_fill_starts_one_warm_promotion_ahead() -> None:
    # Five more hot replicas, five warm ready: 2 x 1.1 + 1 = 3.2 s ahead.
    assert hot_at(NINE - 10, warm=5) == 1
    assert hot_at(NINE - 3, warm=5) == 6


def test_a_warm_floor_starts_one_standby_load_ahead_in_its_time_zone() -> None:
    paris_nine = NINE - 3600  # 09:00 in Paris is 08:00 UTC in December

    def warm(t: float) -> int:
        return decide(obs(1.0, warm=2, standby=1), EmberState(), CFG, t).desired.warm

    # Two warm and a standby ready (hot fills from warm): the warm stage fills from
    # standby, 5 x 1.1 + 1 = 6.5 s ahead.
    assert warm(paris_nine - 10) == CFG.warm_spares
    got = decide(obs(1.0, warm=2, standby=1), EmberState(), CFG, paris_nine - 6)
    assert got.desired.warm == 4 and "scheduled: 4 warm" in got.reasons
