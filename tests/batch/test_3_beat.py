"""`ember beat`: a schedule fires at its cron time (a controllable clock: `Beat.tick`),
once, even with two beats; paused schedules do not fire; missed runs follow catch_up."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import redis

from ember.batch.beat import Beat
from ember.work.queue import make_celery
from tests.batch.conftest import MODEL, BatchPlatform, read_output, write_jsonl
from tests.gateway.conftest import X


def beat(platform: BatchPlatform) -> Beat:
    return Beat(platform.settings, platform.app.state.engine, make_celery(platform.settings))


def mine(runs: list[Any], name: str) -> list[Any]:
    """The runs of schedule ``name`` (other tests' schedules fire too)."""
    return [r for r in runs if f"/{name}/" in r.input_uri]


def create(platform: BatchPlatform, name: str, **extra: Any) -> dict[str, Any]:
    body = {
        "name": name,
        "cron": "30 2 * * *",
        "timezone": "America/New_York",
        "model": MODEL,
        "input_uri": "file://" + str(platform.root / name / "{date}.jsonl"),
        "output_uri": "file://" + str(platform.root / name / "out" / "{date}"),
        "shard_rows": 40,
    } | extra
    response = platform.client.post("/v1/batch/schedules", json=body)
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_fires_at_its_cron_time_once(platform: BatchPlatform) -> None:
    schedule = create(platform, "fires")
    fire = datetime.fromisoformat(schedule["next_fire_at"])
    local_date = (fire - timedelta(hours=5)).date().isoformat()  # New York is UTC-4/-5
    rows = [{"id": i, "features": X} for i in range(100)]
    write_jsonl(platform.root / "fires" / f"{local_date}.jsonl", rows)
    first, second = beat(platform), beat(platform)
    assert mine(first.tick(fire - timedelta(seconds=1)), "fires") == []
    started = mine(first.tick(fire), "fires")
    assert len(started) == 1
    assert mine(second.tick(fire), "fires") == []
    assert mine(first.tick(fire + timedelta(seconds=30)), "fires") == []
    run = platform.wait_run(started[0].uid)
    assert run["status"] == "succeeded", run
    assert run["schedule"] == "fires"
    assert datetime.fromisoformat(run["fire_at"]) == fire
    assert run["input_uri"].endswith(f"/{local_date}.jsonl")
    assert sorted(r["id"] for r in read_output(run)) == list(range(100))
    listed = platform.client.get("/v1/batch/runs", params={"schedule": "fires"}).json()
    assert [r["id"] for r in listed["items"]] == [run["id"]]
    nxt = platform.client.get("/v1/batch/schedules/fires").json()["next_fire_at"]
    assert datetime.fromisoformat(nxt) == fire + timedelta(days=1)


def test_paused_does_not_fire_and_missing_input_fails_the_run(platform: BatchPlatform) -> None:
    schedule = create(platform, "paused", catch_up="all")
    fire = datetime.fromisoformat(schedule["next_fire_at"])
    platform.client.post("/v1/batch/schedules/paused/pause")
    b = beat(platform)
    assert mine(b.tick(fire + timedelta(days=3)), "paused") == []
    # `all` after three missed days (no input exists): three failed runs, with the reason
    from sqlmodel import Session, select

    from ember.registry.tables import BatchSchedule

    with Session(platform.app.state.engine) as session:
        row = session.exec(select(BatchSchedule).where(BatchSchedule.name == "paused")).one()
        row.paused = False
        session.add(row)
        session.commit()
    started = mine(b.tick(fire + timedelta(days=2, minutes=1)), "paused")
    assert len(started) == 3
    for run in started:
        doc = platform.get_run(run.uid)
        assert doc["status"] == "failed" and "no object at" in (doc["error"] or "")


def test_catch_up_latest_and_skip(platform: BatchPlatform) -> None:
    latest = create(platform, "latest", catch_up="latest")
    skip = create(platform, "skip", catch_up="skip")
    fire = datetime.fromisoformat(latest["next_fire_at"])
    assert datetime.fromisoformat(skip["next_fire_at"]) == fire
    b = beat(platform)
    started = b.tick(fire + timedelta(days=4, hours=1))
    # `latest`: the last missed day only; `skip`: nothing (all too late)
    assert [r.fire_at for r in mine(started, "latest")] == [fire + timedelta(days=4)]
    assert mine(started, "skip") == []
    on_time = mine(b.tick(fire + timedelta(days=5, seconds=1)), "skip")
    assert [r.fire_at for r in on_time] == [fire + timedelta(days=5)]


def test_one_beat_holds_the_lock(platform: BatchPlatform) -> None:
    client = redis.Redis.from_url(platform.redis.url)
    first, second = beat(platform), beat(platform)
    assert first.holds_lock(client)
    assert not second.holds_lock(client)
    assert first.holds_lock(client)  # renewal
    client.close()
