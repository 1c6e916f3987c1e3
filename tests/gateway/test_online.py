"""Online predict end to end through real replicas: routing, canary, stickiness,
failures (SIGKILL, SIGSTOP), overload, and a rollout to a corrupt artifact."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from ember.web.problems import PROBLEM_JSON
from tests.gateway.conftest import Live, X, deploy, live_api, replica_auth


def test_predict_canary_and_sticky_sessions(live: Live) -> None:
    live.register("mlp", "1")
    live.register("mlp", "2")
    deploy(live, "mlp", min_hot=2)
    ok = live.predict("mlp", 2)
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["predictions"]) == 2 and len(ok.json()["predictions"][0]) == 16
    assert ok.headers["x-ember-version"] == "1" and ok.headers["x-ember-replica"]
    # the replica's own time, so a caller can tell it from the gateway's and the network's
    assert 0 < float(ok.headers["x-ember-replica-ms"]) < 60_000
    pinned = live.client.post(
        "/v1/models/mlp/versions/1:predict", json={"instances": [[0.0] * 256]}
    )
    assert pinned.status_code == 200 and pinned.json()["version"] == "1"
    replicas = {r["replica_id"]: r for r in live.ready("mlp")}
    assert len(replicas) == 2 and all(r["pid"] and r["port"] for r in replicas.values())

    # Sticky: one session key stays on one replica while it is not overloaded.
    served = {
        live.predict("mlp", headers={"X-Ember-Session": "user-42"}).headers["x-ember-replica"]
        for _ in range(15)
    }
    assert len(served) == 1

    # Canary: 30 % to version 2, once its replica is ready.
    live.client.post("/v1/deployments/mlp:canary", json={"version": "2", "weight": 30})
    live.wait(lambda: bool(live.ready("mlp", "2")), "canary replica")
    versions = Counter(live.predict("mlp").headers["x-ember-version"] for _ in range(200))
    assert 0.2 <= versions["2"] / 200 <= 0.4, versions  # 3 sigma of Binomial(200, 0.3) = 0.097

    bad = live.client.post("/v1/models/mlp:predict", json={"instances": [[1, 2]]})
    assert bad.status_code == 422 and "shape" in bad.json()["detail"]
    assert live.client.post("/v1/models/nope:predict", json={"instances": [1]}).status_code == 404
    # The lean lane (raw ASGI) and the FastAPI route answer alike: the lane takes a cached
    # key and a valid body, and leaves the rest to the route with the body replayed.
    unknown = live.client.post("/v1/models/mlp/versions/9:predict", json={"instances": [X]})
    assert unknown.status_code == 404 and unknown.headers["content-type"] == PROBLEM_JSON
    malformed = live.client.post("/v1/models/mlp:predict", content=b'{"instances": [')
    assert malformed.status_code == 400 and malformed.json()["type"].endswith("malformed-request")
    empty = live.client.post("/v1/models/mlp:predict", json={"instances": []})
    assert empty.status_code == 422 and empty.json()["errors"][0]["location"] == "instances"
    stranger = httpx.post(f"{live.url}/v1/models/mlp:predict", json={"instances": [X]},
                          headers={"Authorization": "Bearer ek_nope"})  # fmt: skip
    assert stranger.status_code == 401 and stranger.headers["www-authenticate"] == "Bearer"
    fine = live.predict("mlp", headers={"X-Request-Id": "req-7"})
    assert fine.headers["x-request-id"] == "req-7" and fine.headers["x-ember-rung"] == "model"
    assert fine.headers["content-type"] == "application/json"
    metrics = live.client.get("/metrics").text
    ok = (
        'ember_gateway_requests_total{deployment="mlp",model="mlp",outcome="ok",'
        'tenant="default",version="2"}'
    )
    assert ok in metrics


def test_sigkill_under_load_loses_nothing_and_is_replaced(live: Live) -> None:
    live.register("mlp", "1")
    deploy(live, "mlp", min_hot=2)
    victim = live.ready("mlp")[0]
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            statuses.append(live.predict("mlp").status_code)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        workers = [pool.submit(load) for _ in range(4)]
        time.sleep(1.0)
        os.kill(victim["pid"], signal.SIGKILL)
        time.sleep(2.0)
        stop.set()
        for w in workers:
            w.result()
    failed = [s for s in statuses if s != 200]
    assert len(statuses) > 20 and len(failed) <= 0.1 * len(statuses), Counter(statuses)
    live.wait(
        lambda: (
            len(live.ready("mlp")) == 2
            and victim["replica_id"] not in {r["replica_id"] for r in live.ready("mlp")}
        ),
        "replacement",
    )
    assert any(
        e["event"] == "failed" and e["replica_id"] == victim["replica_id"]
        for e in live.events("mlp")
    )


def test_sigstopped_replica_is_detected_and_replaced(live: Live) -> None:
    live.register("mlp", "1")
    deploy(live, "mlp")
    victim = live.ready("mlp")[0]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        live.wait(
            lambda: any(
                e["event"] == "killed" and e["replica_id"] == victim["replica_id"]
                for e in live.events("mlp")
            ),
            "detection",
            60,
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim["pid"], signal.SIGKILL)
    killed = next(e for e in live.events("mlp") if e["event"] == "killed")
    # idle 0.5 s before the first probe, then 2 probes of at most 1 s each, + ticks (0.25 s),
    # + 3 s of scheduling slack for a loaded 2-core CI machine
    assert killed["detected_after_s"] <= 0.5 + 2 * (1.0 + 0.25) + 3.0, killed
    assert killed["detected_after_s"] >= 0.5 + 1.0, killed  # not before two probes could fail
    live.wait(lambda: len(live.ready("mlp")) == 1, "replacement")
    assert live.predict("mlp").status_code == 200


def test_overload_sheds_with_429_never_5xx(live: Live) -> None:
    live.register("slow", "1", slow_s=0.2)
    deploy(live, "slow", max_batch_size=2, max_queue_delay_ms=0)
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        responses = list(pool.map(lambda _: live.predict("slow", timeout_ms=10_000), range(120)))
    codes = Counter(r.status_code for r in responses)
    assert set(codes) <= {200, 429}, codes
    assert codes[429] > 0 and codes[200] > 0, codes
    shed = next(r for r in responses if r.status_code == 429)
    assert int(shed.headers["retry-after"]) >= 1
    assert shed.headers["content-type"].startswith("application/problem+json")


def test_rollout_to_a_corrupt_artifact_keeps_the_old_version_serving(live: Live) -> None:
    live.register("mlp", "1")
    path = live.register("mlp", "2")
    deploy(live, "mlp")
    with path.open("r+b") as fh:  # flip bytes after registration: the sha256 no longer matches
        fh.seek(-64, os.SEEK_END)
        fh.write(b"\xff" * 64)
    assert live.client.post("/v1/deployments/mlp:promote", json={"version": "2"}).status_code == 200
    live.wait(
        lambda: any(e["event"] == "failed" and e["version"] == "2" for e in live.events("mlp")),
        "the corrupt version to fail",
        120,
    )
    for _ in range(10):
        response = live.predict("mlp")
        assert response.status_code == 200 and response.headers["x-ember-version"] == "1"
    failure = next(e for e in live.events("mlp") if e["event"] == "failed" and e["version"] == "2")
    assert "sha256" in failure["reason"].lower()


def test_the_autoscaler_adds_replicas_under_load(live: Live) -> None:
    """Uncalibrated, a replica is assumed to serve max_batch_size units/s: 1/s here, so a
    steady ~5 requests/s wants 5 / (1 x 0.7) = 8 hot replicas, capped at max_replicas = 3."""
    live.register("slow", "1", slow_s=0.1)
    deploy(live, "slow", min_hot=1, max_replicas=3, max_batch_size=1, max_queue_delay_ms=0)
    stop = threading.Event()
    codes: Counter[int] = Counter()

    def load() -> None:
        while not stop.is_set():
            codes[live.predict("slow", timeout_ms=20_000).status_code] += 1
            time.sleep(0.1)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        workers = [pool.submit(load) for _ in range(2)]
        try:
            live.wait(lambda: len(live.ready("slow")) == 3, "3 hot replicas", 240)
        finally:
            stop.set()
            for w in workers:
                w.result()
    assert set(codes) <= {200, 429}, codes
    started = [e for e in live.events("slow") if e["event"] == "starting"]
    assert len(started) >= 3
    assert len(live.replicas("slow")) <= 3  # never above max_replicas


def test_a_deployment_takes_a_ready_standby_process(data_dir: Path) -> None:
    """With a standby process ready (runtime imported, no weights), a new deployment's
    replica is that process, assigned its version — no interpreter start, no imports."""
    with live_api(data_dir, standby_replicas=1) as live:
        client = live.client
        standby = 'deployment="(standby)",model="-",state="standby"'
        live.wait(lambda: standby in client.get("/metrics").text, "a ready standby process")
        live.register("mlp", "1")
        deploy(live, "mlp", max_batch_size=16, max_queue_delay_ms=2, placement={"threads": 1})
        assigned = [e for e in live.events("mlp") if e["event"] == "assigned"]
        assert assigned and assigned[0]["from_tier"] == "standby"
        (replica,) = live.ready("mlp")
        assert replica["replica_id"] == assigned[0]["replica_id"]
        assert live.predict("mlp").status_code == 200
        # it serves with the deployment's batch policy and threads, not the standby's defaults
        info = httpx.get(f"{replica['url']}/info", headers=replica_auth(replica)).json()
        assert (info["policy"]["max_batch_size"], info["policy"]["max_queue_delay_ms"]) == (16, 2)
        assert info["threads"] == 1


def test_a_request_waits_for_a_starting_replica_within_its_deadline(live: Live) -> None:
    """Right after a deploy nothing is ready yet: a request with a deadline long enough
    for the cold start waits for the replica instead of being refused."""
    live.register("mlp", "1")
    created = live.client.post("/v1/deployments", json={"model": "mlp", "version": "1"})
    assert created.status_code == 201
    live.wait(lambda: bool(live.replicas("mlp")), "the controller to start a replica", 30)
    assert not live.ready("mlp")
    answer = live.predict("mlp", timeout_ms=120_000)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-ember-version"] == "1"


def test_pool_settings_reach_the_controller(data_dir: Path) -> None:
    """EMBER_SCALE_FILL_WARM and the standby pool's bounds are the live controller's."""
    from ember.api.app import create_app
    from ember.config import Settings
    from tests.gateway.conftest import ADMIN_KEY
    from tests.services import serve_app

    settings = Settings(
        data_dir=data_dir, admin_key=ADMIN_KEY, scale_fill_warm=True,  # type: ignore[arg-type]
        standby_replicas=0, standby_max_replicas=3,
    )  # fmt: skip
    app = create_app(settings)
    with serve_app(app):
        controller = app.state.pools
        assert controller.fill_warm is True
        assert (controller.standby.floor, controller.standby.maximum) == (0, 3)
