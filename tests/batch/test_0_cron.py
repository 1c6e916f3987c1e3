"""Fire times: computed in the schedule's zone, across DST neither skipped nor doubled."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from ember.batch.schemas import check_cron, fire_times, next_fire, zone


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def test_daily_time_stays_local_across_dst() -> None:
    spring = fire_times("30 2 * * *", "Europe/Paris", utc(2026, 3, 27), utc(2026, 3, 31), 10)
    # 02:30 does not exist on 29 March: it fires once, at the jump (03:00 CEST).
    assert spring == [
        utc(2026, 3, 27, 1, 30),
        utc(2026, 3, 28, 1, 30),
        utc(2026, 3, 29, 1, 0),
        utc(2026, 3, 30, 0, 30),
    ]
    autumn = fire_times("30 2 * * *", "Europe/Paris", utc(2026, 10, 24), utc(2026, 10, 27), 10)
    # 02:30 happens twice on 25 October: it fires once.
    assert autumn == [utc(2026, 10, 24, 0, 30), utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)]
    assert next_fire("30 2 * * *", "Europe/Paris", utc(2026, 10, 25, 0, 30)) == utc(
        2026, 10, 26, 1, 30
    )


def test_zone_matters() -> None:
    assert next_fire("0 2 * * *", "America/New_York", utc(2026, 1, 1)) == utc(2026, 1, 1, 7)
    assert next_fire("0 2 * * *", "UTC", utc(2026, 1, 1)) == utc(2026, 1, 1, 2)


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("61 * * * *", "invalid cron"),
        ("* * *", "5 fields"),
        ("0 0 30 2 *", "never fires"),
        ("@daily", "5 fields"),
    ],
)
def test_bad_cron(expr: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_cron(expr)


@pytest.mark.parametrize("name", ["Mars/Olympus", "", "../etc/passwd", "/etc/localtime"])
def test_bad_zone(name: str) -> None:
    with pytest.raises(ValueError, match="unknown IANA time zone"):
        zone(name)
