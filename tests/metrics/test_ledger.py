"""The cost ledger (``ember.pools.costs``) on a real Redis and in memory: the windows, the
lifetime, the standby share by the starts served, and two ledgers (two API processes)
reading the same figure."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ember.pools.costs import CostLedger
from tests.gateway.conftest import Live, deploy, live_api
from tests.jobs.conftest import RedisProc

STANDBY = (0, "", "-", "-", "standby")
A = (1, "search", "minilm", "1")
B = (2, "chat", "tiny", "7")


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0  # a whole hour: the buckets below are easy to reason on

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    redis = RedisProc(tmp_path_factory.mktemp("ledger-redis"))
    redis.start()
    yield redis.url
    redis.kill()


@pytest.fixture(params=["redis", "memory"])
def ledgers(
    request: pytest.FixtureRequest, redis_server: str
) -> Iterator[tuple[CostLedger, CostLedger, Clock]]:
    """Two ledgers as two API processes hold them (in memory: one process, one ledger)."""
    clock = Clock()
    prefix = f"test:{request.node.name}"
    if request.param == "redis":
        one = CostLedger(redis_server, prefix=prefix, clock=clock)
        two = CostLedger(redis_server, prefix=prefix, clock=clock)
    else:
        one = two = CostLedger(None, prefix=prefix, clock=clock)
    yield one, two, clock
    one.close()
    two.close()


def test_windows_lifetime_and_the_standby_share(
    ledgers: tuple[CostLedger, CostLedger, Clock],
) -> None:
    leader, follower, clock = ledgers
    # 10 minutes ago: 300 hot seconds of A, 100 standby seconds, one start of A from
    # standby, 10 answers of A (5 through each process)
    leader.add_seconds((*A, "hot"), 300.0)
    leader.add_seconds(STANDBY, 100.0)
    leader.add_standby_start(A)
    for ledger in (leader, follower):
        for _ in range(5):
            ledger.add_success(A)
    leader.flush()
    follower.flush()
    clock.now += 600
    # now: 60 hot + 20 warm seconds of A, 60 of B, 40 standby, starts 1 of A and 3 of B
    leader.add_seconds((*A, "hot"), 60.0)
    leader.add_seconds((*A, "warm"), 20.0)
    leader.add_seconds((*B, "hot"), 60.0)
    leader.add_seconds(STANDBY, 40.0)
    leader.add_standby_start(A)
    for _ in range(3):
        leader.add_standby_start(B)
    for _ in range(4):
        follower.add_success(A)
    for _ in range(6):
        follower.add_success(B)
    leader.flush()
    follower.flush()

    mine, theirs = leader.snapshot(), follower.snapshot()
    a = mine.of_deployment(1, "search")
    assert a == theirs.of_deployment(1, "search")  # the same from both processes
    v = a["versions"]["1"]
    # last 5 minutes: (60 + 20 + 40 * 1/4) / 4
    assert v["window"]["5m"] == pytest.approx((60 + 20 + 10) / 4)
    # the hour and the day hold both rounds: standby 140 s, 2 of 5 starts were A's
    both = (300 + 60 + 20 + 140 * 2 / 5) / 14
    assert v["window"]["1h"] == pytest.approx(both)
    assert v["window"]["24h"] == pytest.approx(both)
    assert v["lifetime"] == pytest.approx(both)
    assert v["breakdown"]["5m"]["replica_seconds"] == pytest.approx(
        {"hot": 60, "warm": 20, "standby_share": 10}
    )
    assert v["breakdown"]["lifetime"]["successes"] == 14
    assert v["breakdown"]["lifetime"]["standby_starts"] == 2
    b = mine.of_deployment(2, "chat")["versions"]["7"]
    assert b["window"]["5m"] == pytest.approx((60 + 40 * 3 / 4) / 6)
    assert b["lifetime"] == pytest.approx((60 + 140 * 3 / 5) / 6)
    # a tenant sees its deployment only: another tenant's name is another deployment
    assert mine.of_deployment(2, "search")["versions"] == {}

    clock.now += 25 * 3600  # a day later: the windows are empty, the lifetime is not
    later = leader.snapshot().of_deployment(1, "search")["versions"]["1"]
    assert later["window"] == {"5m": None, "1h": None, "24h": None}
    assert later["lifetime"] == pytest.approx(both)


def test_standby_seconds_without_a_start_stay_unapportioned(
    ledgers: tuple[CostLedger, CostLedger, Clock],
) -> None:
    leader, _, _ = ledgers
    leader.add_seconds((*A, "hot"), 30.0)
    leader.add_seconds(STANDBY, 1000.0)
    leader.add_success(A)
    leader.flush()
    v = leader.snapshot().of_deployment(1, "search")["versions"]["1"]
    assert v["lifetime"] == pytest.approx(30.0)
    assert v["breakdown"]["lifetime"]["replica_seconds"]["standby_share"] == 0


def test_counts_survive_a_redis_outage(tmp_path: Path) -> None:
    redis = RedisProc(tmp_path)
    redis.start()
    clock = Clock()
    ledger = CostLedger(redis.url, prefix="outage", clock=clock)
    try:
        ledger.add_success(A)
        ledger.flush()
        redis.kill()
        ledger.add_success(A)
        ledger.flush()  # fails: kept for the next flush
        assert ledger.flush_errors == 1
        redis.start()  # empty (no persistence): only what was kept comes back
        ledger.flush()
        life = ledger.snapshot().of_deployment(1, "search")["versions"]["1"]["breakdown"]
        assert life["lifetime"]["successes"] == 1
    finally:
        ledger.close()
        redis.kill()


def _standby_seconds(live: Live) -> float:
    text = live.client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "ember_cost_replica_seconds":
            return sum(s.value for s in family.samples if s.labels["tier"] == "standby")
    return 0.0


def test_a_standby_process_is_paid_by_the_deployment_whose_start_it_served(
    data_dir: Path,
) -> None:
    """One API process, no Redis (the ledger in memory), one standby process: the
    deployment's replica is that process, assigned — its start was served by standby, so
    every standby second (the refilled pool's too) is the deployment's."""
    with live_api(data_dir, standby_replicas=1) as live:
        ready = 'deployment="(standby)",model="-",state="standby"'
        live.wait(lambda: ready in live.client.get("/metrics").text, "a ready standby process")
        live.register("mlp", "1")
        deploy(live, "mlp")
        assert live.predict("mlp").status_code == 200
        events = live.events("mlp")
        assert any(e["event"] == "assigned" for e in events), events
        live.wait(
            lambda: (
                live.client.get("/v1/deployments/mlp/cost").json()["versions"]["1"]["breakdown"][
                    "lifetime"
                ]["standby_starts"]
                == 1
            ),
            "the standby start counted",
        )
        before = _standby_seconds(live)
        cost = live.client.get("/v1/deployments/mlp/cost").json()["versions"]["1"]
        after = _standby_seconds(live)
        share = cost["breakdown"]["lifetime"]["replica_seconds"]["standby_share"]
        assert before <= share <= after  # all of it: the only start was this version's
        own = cost["breakdown"]["lifetime"]["replica_seconds"]["hot"]
        assert cost["lifetime"] == pytest.approx((own + share) / 1)


def test_the_cost_route_answers_503_while_redis_is_away(data_dir: Path, tmp_path: Path) -> None:
    redis = RedisProc(tmp_path)
    redis.start()
    try:
        with live_api(data_dir, redis_url=redis.url, standby_replicas=0) as live:
            live.register("mlp", "1")
            deploy(live, "mlp")
            assert live.predict("mlp").status_code == 200
            assert live.client.get("/v1/deployments/mlp/cost").status_code == 200
            redis.kill()
            away = live.client.get("/v1/deployments/mlp/cost")
            assert away.status_code == 503, away.text
            assert away.headers["content-type"].startswith("application/problem+json")
            assert str(redis.port) not in away.text and "redis" not in away.text.lower()
            redis.start()  # back (empty): the counts kept in memory meanwhile arrive
            live.wait(
                lambda: live.client.get("/v1/deployments/mlp/cost").status_code == 200,
                "the cost route back with Redis",
                30,
            )
    finally:
        redis.kill()
