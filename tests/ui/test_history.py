"""The dashboard's time series (ember.pools.history): bounded in memory, shared through a
real Redis between processes, read after a point in time; and the answers window."""

from __future__ import annotations

import time
from typing import Any

from ember.pools.history import History, redis_key
from ember.serving.stats import RequestStats


def sample(t: float, hot: int = 1, arrived: float | None = 0.0) -> dict[str, Any]:
    return {
        "t": t,
        "version": "1",
        "replicas": {"hot": hot, "warm": 0, "standby": 0, "starting": 0},
        "arrived_units_per_s": arrived,
        "admitted_units_per_s": arrived,
        "forecast": [{"tier": "hot", "horizon_s": 9.0, "units_per_s": 1.5}],
    }


def test_memory_is_bounded_by_count_and_age() -> None:
    history = History(None, every_s=1.0, keep_s=10.0)
    assert history.max_samples == 10
    for t in range(100, 125):
        history.store({(1, "a"): sample(float(t), hot=t % 3)})
    kept = history.series((1, "a"))
    assert [s["t"] for s in kept] == [float(t) for t in range(115, 125)]
    assert history.series((1, "a"), since=120.0) == [
        sample(float(t), hot=t % 3) for t in (121, 122, 123, 124)
    ]
    assert history.series((2, "a")) == []  # another tenant's deployment of the same name
    # a deployment that stopped being sampled is dropped once its samples are all too old
    history.store({(1, "b"): sample(200.0)})
    assert (1, "a") not in history.memory


def test_redis_shares_the_samples_between_processes(redis_url: str) -> None:
    writer = History(redis_url, every_s=1.0, keep_s=5.0, prefix="test:history")
    reader = History(redis_url, every_s=1.0, keep_s=5.0, prefix="test:history")
    try:
        now = time.time()
        for i in range(8):
            writer.store({(7, "d"): sample(now + i, hot=i), (8, "d"): sample(now + i, hot=9)})
        got = reader.series((7, "d"))
        # keep_s=5 at one sample a second: the newest 5
        assert [s["replicas"]["hot"] for s in got] == [3, 4, 5, 6, 7]
        assert got == [sample(now + i, hot=i) for i in range(3, 8)]
        assert [s["replicas"]["hot"] for s in reader.series((7, "d"), since=now + 5)] == [6, 7]
        assert {s["replicas"]["hot"] for s in reader.series((8, "d"))} == {9}
        import redis

        client = redis.Redis.from_url(redis_url)
        ttl = client.ttl(redis_key((7, "d"), "test:history"))
        assert 0 < ttl <= 5
        client.close()
    finally:
        writer.close()
        reader.close()


def test_answers_window() -> None:
    stats = RequestStats(per_version=100)
    for i in range(1, 101):
        stats.record(1, "d", "1", 200, "model", float(i))
    for _ in range(10):
        stats.record(1, "d", "2", 503, None, 5.0)
    stats.record(1, "d", "2", 200, "fallback", 7.0)
    stats.record(1, "d", "2", 429, None, 0.1)
    stats.record(2, "d", "1", 200, "model", 1000.0)  # another tenant's
    out = stats.summary(1, "d")
    assert out["1"] == {"requests": 100, "p50_ms": 50.0, "p99_ms": 99.0, "error_rate": 0.0,
                        "shed_rate": 0.0, "rungs": {"model": 100}}  # fmt: skip
    assert out["2"]["requests"] == 12 and out["2"]["p50_ms"] == 7.0
    assert out["2"]["error_rate"] == round(10 / 12, 6) and out["2"]["shed_rate"] == round(1 / 12, 6)
    assert out["2"]["rungs"] == {"fallback": 1}
    for _ in range(150):  # bounded per version
        stats.record(1, "d", "1", 200, "model", 1.0)
    assert stats.summary(1, "d")["1"]["requests"] == 100
