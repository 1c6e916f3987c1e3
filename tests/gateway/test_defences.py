"""The online path's defences end to end, with real replicas and a real Redis: the
version-keyed response cache across promote/rollback, single flight, every rung of the
degradation ladder, hedging, and the prediction log (file and S3 sinks, sink failures)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
import redis

from ember.api.app import create_app
from ember.config import Settings
from ember.domain.spec import VersionSpec
from ember.pools.controller import PoolsController
from ember.registry.schemas import PoolPolicy
from ember.serving.admission import Admission
from ember.serving.gateway import Gateway
from ember.serving.router import RetryBudget, Route
from ember.serving.routing import DeploymentView
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.gateway.conftest import Live, deploy, replica_auth
from tests.gateway.test_hop import answer as http_answer
from tests.gateway.test_hop import read_request, serve
from tests.pools.test_controller_autoscale import FakeBackend

Y = [0.25] * 256


@contextlib.contextmanager
def make_live(data_dir: Path, **overrides: Any) -> Iterator[Live]:
    fields: dict[str, Any] = {
        "data_dir": data_dir,
        "admin_key": ADMIN_KEY,
        "standby_replicas": 0,
        "probe_idle_s": 0.5,
        "probe_timeout_s": 1.0,
        "probe_failures": 2,
        "prediction_log_window_s": 0.2,
    }
    settings = Settings(**(fields | overrides))
    with services.serve_app(create_app(settings)) as url:
        client = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )
        yield Live(url, client, data_dir / "objects")
        client.close()


@pytest.fixture
def cache_redis(redis_url: str) -> str:
    """A Redis database of its own, emptied: other tests' entries cannot answer here."""
    url = redis_url.rsplit("/", 1)[0] + "/7"
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture
def live(data_dir: Path, cache_redis: str) -> Iterator[Live]:
    with make_live(data_dir, redis_url=cache_redis) as running:
        yield running


def predict(live: Live, model: str, x: list[float], **extra: Any) -> httpx.Response:
    return live.client.post(f"/v1/models/{model}:predict", json={"instances": [x], **extra})


def records(data_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted((data_dir / "predictions").glob("predictions-*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def replica_inferences(replica: dict[str, Any]) -> float:
    """Online requests the replica answered (its health probes are not counted)."""
    text = httpx.get(f"{replica['url']}/metrics", headers=replica_auth(replica), timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ember_request_latency_seconds_count") and 'priority="online"' in line
    )


def metric(live: Live, name: str, **labels: str) -> float:
    text = live.client.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        mine = line.startswith(name + "{") or line.startswith(name + " ")
        if mine and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_cache_never_answers_for_another_version(live: Live, cache_redis: str) -> None:
    live.register("mlp", "1")
    live.register("mlp", "2")
    deploy(live, "mlp", cache_ttl_s=600)

    first = predict(live, "mlp", Y)
    assert first.status_code == 200, first.text
    assert (first.headers["x-ember-version"], first.headers["x-ember-cache"]) == ("1", "miss")
    again = predict(live, "mlp", Y)
    assert (again.headers["x-ember-version"], again.headers["x-ember-cache"]) == ("1", "hit")
    assert again.json()["predictions"] == first.json()["predictions"]
    v1 = first.json()["predictions"]

    assert live.client.post("/v1/deployments/mlp:promote", json={"version": "2"}).status_code == 200
    live.wait(lambda: predict(live, "mlp", Y).headers["x-ember-version"] == "2", "v2 serving")
    answers = [predict(live, "mlp", Y) for _ in range(5)]
    for answer in answers:
        assert answer.headers["x-ember-version"] == "2"
        assert answer.json()["predictions"] != v1, "a v2 answer carries v1's prediction"
    v2 = answers[0].json()["predictions"]
    assert {a.headers["x-ember-cache"] for a in answers} == {"hit"}  # the first v2 was a miss

    assert live.client.post("/v1/deployments/mlp:rollback").status_code == 200
    live.wait(lambda: predict(live, "mlp", Y).headers["x-ember-version"] == "1", "v1 back")
    back = predict(live, "mlp", Y)
    assert back.json()["predictions"] == v1 != v2
    # A pinned version shares its version's entries, and only those.
    pinned = live.client.post("/v1/models/mlp/versions/1:predict", json={"instances": [Y]})
    assert pinned.headers["x-ember-version"] == "1" and pinned.json()["predictions"] == v1
    assert pinned.headers["x-ember-cache"] == "hit"
    # Every key in Redis names its version.
    keys = redis.Redis.from_url(cache_redis).keys("ember:rc:v1:*")
    assert keys and all(k.split(b":")[5] in (b"1", b"2") for k in keys if b":lock:" not in k)


def test_concurrent_identical_misses_run_one_inference(live: Live) -> None:
    live.register("slow", "1", slow_s=0.5)
    deploy(live, "slow", cache_ttl_s=600)
    replica = live.ready("slow")[0]
    before = replica_inferences(replica)
    x = [0.125] * 256

    def one(_: int) -> httpx.Response:
        return predict(live, "slow", x, timeout_ms=60_000)

    with concurrent.futures.ThreadPoolExecutor(100) as pool:
        answers = list(pool.map(one, range(100)))
    assert {a.status_code for a in answers} == {200}
    assert len({json.dumps(a.json()["predictions"]) for a in answers}) == 1
    outcomes = [a.headers["x-ember-cache"] for a in answers]
    assert outcomes.count("miss") == 1, outcomes
    assert replica_inferences(replica) - before == 1


def test_every_rung_of_the_ladder(data_dir: Path, cache_redis: str) -> None:
    """A slow production version (2 s per batch) that a short deadline cannot wait for, a
    fast fallback version, a stale-tolerant cache and a safe default. (Probes get 5 s: a
    probe's forward pass cannot overtake the 2 s one already running.)"""
    with make_live(data_dir, redis_url=cache_redis, probe_timeout_s=5.0) as live:
        check_every_rung(live)


def check_every_rung(live: Live) -> None:
    live.register("ladder", "1", slow_s=2.0)
    live.register("ladder", "2")
    deploy(live, "ladder", cache_ttl_s=0.2, cache_stale_s=600, fallback=["2"])
    live.wait(lambda: len(live.ready("ladder")) == 2, "production's and the fallback's replicas")
    ok = predict(live, "ladder", Y, timeout_ms=30_000)
    assert (ok.status_code, ok.headers["x-ember-rung"], ok.headers["x-ember-version"]) == (
        200, "model", "1",
    )  # fmt: skip
    time.sleep(0.3)  # past the TTL: the entry is stale now, usable only by the ladder

    stale = predict(live, "ladder", Y, timeout_ms=800)
    assert (stale.status_code, stale.headers["x-ember-rung"]) == (200, "cache"), stale.text
    assert stale.headers["x-ember-cache"] == "stale"
    assert stale.json()["predictions"] == ok.json()["predictions"]

    # 3/4 of the deadline for the model (which cannot make it), 1/4 kept for the fallback
    fallback = predict(live, "ladder", [0.75] * 256, timeout_ms=2000)
    assert (fallback.status_code, fallback.headers["x-ember-rung"]) == (200, "fallback")
    assert fallback.headers["x-ember-version"] == "2"

    default = [0.0] * 16
    patched = live.client.patch(
        "/v1/deployments/ladder", json={"fallback": [], "safe_default": default}
    )
    assert patched.status_code == 200, patched.text
    live.wait(
        lambda: (
            predict(live, "ladder", [0.6] * 256, timeout_ms=300).headers.get("x-ember-rung")
            == "default"
        ),
        "the default rung",
        60,
    )
    answer = predict(live, "ladder", [0.6] * 256, timeout_ms=300)
    assert answer.status_code == 200 and answer.json()["predictions"] == [default]

    # Without any rung left, the failure is the model's own error, not a made-up answer.
    cleared = live.client.patch(
        "/v1/deployments/ladder", json={"safe_default": None, "cache_stale_s": 0}
    )
    assert cleared.status_code == 200 and cleared.json()["safe_default"] is None
    live.wait(
        lambda: predict(live, "ladder", [0.6] * 256, timeout_ms=300).status_code == 504,
        "no ladder",
        60,
    )
    # Bad input never degrades: it is the caller's error on every rung.
    bad = live.client.post("/v1/models/ladder:predict", json={"instances": [[1.0, 2.0]]})
    assert bad.status_code == 422 and "x-ember-rung" not in bad.headers

    for rung in ("model", "cache", "fallback", "default"):
        assert metric(live, "ember_ladder_rung_total", deployment="ladder", rung=rung) >= 1, rung


def test_the_prediction_log_holds_one_record_per_answer(live: Live, data_dir: Path) -> None:
    live.register("mlp", "1")
    deploy(live, "mlp", log_payloads=True, cache_ttl_s=600)
    sha256 = live.client.get("/v1/models/mlp/versions/1").json()["sha256"]
    answers = [predict(live, "mlp", [i / 10] * 256) for i in range(5)]
    answers += [predict(live, "mlp", [0.05] * 256) for _ in range(3)]  # 1 miss + 2 hits
    failed = live.client.post("/v1/models/mlp:predict", json={"instances": [[1.0]]})
    assert failed.status_code == 422
    assert {a.status_code for a in answers} == {200}
    ids = [a.headers["x-request-id"] for a in answers]
    live.wait(lambda: len([r for r in records(data_dir) if r["status"] == 200]) >= 8, "log")
    time.sleep(0.5)  # any (wrong) extra record would have been flushed by now
    logged = [r for r in records(data_dir) if r["status"] == 200]
    assert sorted(r["request_id"] for r in logged) == sorted(ids)
    by_id = {r["request_id"]: r for r in logged}
    for answer in answers:
        record = by_id[answer.headers["x-request-id"]]
        assert record["model"] == "mlp" and record["version"] == "1"
        assert record["artifact_sha256"] == sha256
        assert record["rung"] == "model" and record["cache"] == answer.headers["x-ember-cache"]
        assert record["output"] == answer.json()
        assert len(record["input_digest"]) == len(record["output_digest"]) == 64
    # Time in the replica's queue, as the replicas report it, per deployment and version.
    assert metric(live, "ember_gateway_queue_seconds_count", deployment="mlp", version="1") >= 6
    # The replica's refusal is logged too, as what it was.
    refused = [r for r in records(data_dir) if r["request_id"] == failed.headers["x-request-id"]]
    assert [r["status"] for r in refused] == [422]


def test_the_prediction_log_goes_to_s3_in_windows(data_dir: Path, moto_endpoint: str) -> None:
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="predlog")
    with make_live(
        data_dir,
        prediction_log_url="s3://predlog/online",
        s3_endpoint_url=moto_endpoint,
    ) as live:
        live.register("mlp", "1")
        deploy(live, "mlp")
        ids = {predict(live, "mlp", Y).headers["x-request-id"] for _ in range(4)}

        def logged() -> list[dict[str, Any]]:
            objects = s3.list_objects_v2(Bucket="predlog", Prefix="online/").get("Contents", [])
            lines: list[dict[str, Any]] = []
            for o in objects:
                body = s3.get_object(Bucket="predlog", Key=o["Key"])["Body"].read()
                lines += [json.loads(x) for x in body.splitlines()]
            return lines

        live.wait(lambda: {r["request_id"] for r in logged()} >= ids, "records in S3", 30)
        assert sorted(r["request_id"] for r in logged()) == sorted(ids)


def test_a_dead_log_sink_fails_no_request(data_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("the log directory cannot be created under a file")
    with make_live(
        data_dir, prediction_log_url=(blocker / "predictions").as_uri(), prediction_log_backlog=3
    ) as live:
        live.register("mlp", "1")
        deploy(live, "mlp")
        answers = [predict(live, "mlp", [i / 7] * 256) for i in range(10)]
        assert {a.status_code for a in answers} == {200}
        live.wait(
            lambda: metric(live, "ember_prediction_log_sink_errors_total") >= 1,
            "a failed flush",
            30,
        )
        assert metric(live, "ember_prediction_log_records_total", fate="dropped") >= 7
        assert metric(live, "ember_prediction_log_records_total", fate="written") == 0


def test_hedging_answers_around_a_stuck_replica(live: Live) -> None:
    live.register("mlp", "1")
    deploy(live, "mlp", min_hot=2, max_replicas=2)
    # Answers for a p95 first, hedging off: on a busy host some of them would be slower than
    # the p95 of the first 20 and be hedged, spending what the budget earned.
    for _ in range(40):
        assert predict(live, "mlp", Y).status_code == 200
    changed = live.client.patch("/v1/deployments/mlp", json={"hedge": True})
    assert changed.status_code == 200 and changed.json()["hedge"] is True, changed.text
    # Idle replicas tie on in-flight units and the router then takes the lowest id: stop
    # that one, so every request goes to it first and only a hedge can answer quickly.
    stuck = min(live.ready("mlp"), key=lambda r: r["replica_id"])
    os.kill(stuck["pid"], signal.SIGSTOP)
    try:
        answers = [predict(live, "mlp", [i / 9] * 256, timeout_ms=20_000) for i in range(6)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stuck["pid"], signal.SIGKILL)
    assert {a.status_code for a in answers} == {200}
    assert all(a.headers["x-ember-replica"] != stuck["replica_id"] for a in answers)
    assert metric(live, "ember_hedges_total", deployment="mlp", outcome="won") >= 1


def test_hedges_never_spend_the_reserve_that_retries_need() -> None:
    # CI saw it: slow answers on a busy host were hedged until the budget was empty, then a
    # stuck replica's request could not be retried when its health probes killed it (502).
    budget = RetryBudget(ratio=0.1, reserve=3.0)
    assert not budget.try_withdraw(hedge=True)  # nothing earned yet; the reserve is not for it
    for _ in range(25):  # 2.5 retries earned above the reserve
        budget.deposit()
    assert [budget.try_withdraw(hedge=True) for _ in range(3)] == [True, True, False]
    assert [budget.try_withdraw() for _ in range(4)] == [True, True, True, False]
    for _ in range(10):  # one more retry earned
        budget.deposit()
    assert budget.try_withdraw()
    assert not budget.try_withdraw() and not budget.try_withdraw(hedge=True)
    for _ in range(1000):  # a long quiet-but-busy run banks at most 10 above the reserve
        budget.deposit()
    assert sum(budget.try_withdraw(hedge=True) for _ in range(20)) == 10


def test_the_gateway_hedges_only_from_what_was_earned() -> None:
    """In process, against scripted replicas (one never answers, one does): with the
    budget at its reserve no hedge goes out and the request waits for the stuck one; with
    a retry earned above the reserve the hedge goes out and wins."""
    controller = PoolsController(None, FakeBackend(), standby_pool=0)  # type: ignore[arg-type]
    view = DeploymentView(
        1,
        "mlp",
        "mlp",
        {"1": 100},
        PoolPolicy(hedge=True),
        {
            "1": VersionSpec(
                model="mlp", version="1", artifact_uri="file:///mlp", sha256="", engine="torch"
            )
        },
        [],
    )
    gateway = Gateway(controller, Admission(1e9, 1e9), 0.1)
    payload: dict[str, Any] = {"instances": [[0.5]], "timeout_ms": 300.0}

    async def stuck(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    async def quick(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(http_answer(b'{"predictions": [1.0], "model": "mlp", "version": "1"}'))
        await writer.drain()

    async def both(slow_url: str, ok_url: str) -> None:
        slow, ok = Route("slow", slow_url, "1"), Route("ok", ok_url, "1")
        budget = gateway.budget
        budget.balance = budget.reserve  # nothing earned: the reserve is for retries
        with pytest.raises(TimeoutError):
            await gateway._hedged(slow, [ok], payload, {}, 1.0, 0.3, 0.05, view, "1", set())
        budget.balance = budget.reserve + 1.0
        got, route, hedged = await gateway._hedged(
            slow, [ok], payload, {}, 1.0, 5.0, 0.05, view, "1", set()
        )
        assert (got.status_code, route.replica_id, hedged) == (200, "ok", True)
        assert budget.balance == pytest.approx(budget.reserve)
        await gateway.hop.close()
        await gateway.http.aclose()

    asyncio.run(serve(stuck, lambda slow_url: serve(quick, lambda ok_url: both(slow_url, ok_url))))
    assert (
        controller.metrics.hedges.labels(*controller.metrics.of(view), "1", "sent")._value.get()
        == 1
    )
