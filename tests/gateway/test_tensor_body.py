"""``:predict`` with a tensor body (``application/x-ember-tensor``), the batch lane's
form: passed through the gateway to the replica as bytes, answered as JSON predictions
are, refused as problems when hostile, and held to the batch class's share of the queue
while online traffic keeps the rest."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from ember.domain.spec import REPLICA_SECRET_HEADER, VersionSpec
from ember.pools.backends.base import ReplicaHandle
from ember.pools.controller import PoolsController
from ember.pools.inventory import ManagedReplica
from ember.registry.schemas import PoolPolicy
from ember.serving.admission import Admission
from ember.serving.gateway import Gateway
from ember.serving.router import Route
from ember.serving.routing import DeploymentView
from ember.web.tensorbody import MEDIA_TYPE, TensorBody
from tests.gateway.conftest import Live, X, deploy
from tests.pools.test_controller_autoscale import FakeBackend

PROBLEM = "application/problem+json"


def tensor(live: Live, path: str, body: TensorBody, **headers: str) -> httpx.Response:
    return live.client.post(
        path, content=body.data, headers={"content-type": body.content_type, **headers}
    )


def test_a_tensor_body_answers_as_json_does(live: Live) -> None:
    live.register("mlp", "1")
    deploy(live, "mlp", max_batch_size=8)
    x = np.random.default_rng(1).standard_normal((20, 256)).astype(np.float32)
    body = TensorBody.of(x)
    path = "/v1/models/mlp/versions/1:predict"
    answer = tensor(live, path, body, **{"x-ember-priority": "batch"})
    assert answer.status_code == 200, answer.text
    expected = live.client.post(path, json={"instances": x.tolist()})
    assert answer.json()["predictions"] == expected.json()["predictions"]
    assert answer.json()["version"] == "1" and answer.headers["x-ember-version"] == "1"
    # the batch class may keep 2 of the replica's 4 batches of 8: 16 instances
    assert answer.headers["x-ember-batch-window"] == "16"
    assert "x-ember-batch-window" not in expected.headers  # online answers do not say
    routed = tensor(live, "/v1/models/mlp:predict", body, **{"x-ember-timeout-ms": "30000"})
    assert routed.status_code == 200
    assert routed.json()["predictions"] == answer.json()["predictions"]

    # every answer is in the prediction log, its input digested from the bytes
    log = Path(live.store).parent / "predictions"

    def logged() -> list[dict[str, Any]]:
        return [json.loads(x) for f in log.rglob("*.jsonl") for x in f.read_text().splitlines()]

    live.wait(lambda: any(r["input_digest"] == body.digest() for r in logged()), "the log", 30)
    record = next(r for r in logged() if r["input_digest"] == body.digest())
    assert record["instances"] == 20 and record["status"] == 200 and record["version"] == "1"


def test_hostile_tensor_bodies_are_problems_at_the_gateway(live: Live) -> None:
    live.register("mlp", "1")
    deploy(live, "mlp")
    good = TensorBody.of(np.zeros((2, 256), np.float32))
    path = "/v1/models/mlp:predict"
    cases: list[tuple[int, bytes, str, dict[str, str]]] = [
        (400, good.data[:-1], good.content_type, {}),  # truncated
        (400, good.data, f"{MEDIA_TYPE}; dtype=float32; shape=3,256", {}),  # wrong length
        (400, good.data, f"{MEDIA_TYPE}; dtype=bfloat17; shape=2,256", {}),  # wrong dtype
        (400, good.data, good.content_type, {"x-ember-timeout-ms": "0"}),
        (413, b"", f"{MEDIA_TYPE}; dtype=float32; shape=10001,256", {}),
        (422, good.data, f"{MEDIA_TYPE}; dtype=float32; shape=2,16,16", {}),  # the replica
        (422, good.data, good.content_type, {"x-ember-priority": "urgent"}),
        (422, good.data, good.content_type, {"x-ember-session": "s" * 300}),
        (401, good.data, good.content_type, {"authorization": "Bearer nope"}),
        (401, good.data, good.content_type, {"authorization": ""}),
        (404, good.data, good.content_type, {"x-ember-tenant": "nobody"}),
    ]
    for status, data, content_type, headers in cases:
        answer = live.client.post(
            path, content=data, headers={"content-type": content_type, **headers}
        )
        assert answer.status_code == status, (content_type, headers, answer.text)
        assert answer.headers["content-type"].startswith(PROBLEM), answer.text
    # the tensor type is for :predict only; other bodies than JSON stay 415 there
    assert live.client.post(
        "/v1/models", content=good.data, headers={"content-type": good.content_type}
    ).status_code == 415  # fmt: skip
    assert live.client.post(
        path, content=good.data, headers={"content-type": "application/octet-stream"}
    ).status_code == 415  # fmt: skip
    # a key the lane has not seen yet is authenticated, not refused
    assert live.client.post(path, content=good.data, headers={"content-type": good.content_type}
                            ).status_code == 200  # fmt: skip


def test_batch_tensor_traffic_keeps_to_its_share_while_online_goes_first(live: Live) -> None:
    live.register("slow", "1", slow_s=0.6)
    deploy(live, "slow", max_batch_size=4, max_queue_delay_ms=0)
    batch = TensorBody.of(np.full((4, 256), 0.5, np.float32))
    path = "/v1/models/slow:predict"
    heads = {"x-ember-priority": "batch"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # two full batches: the batch class's share (2 of the replica's 4 batches) ...
        running = [pool.submit(tensor, live, path, batch, **heads) for _ in range(2)]
        time.sleep(0.2)
        # ... so a third waits (429), while online traffic still gets in
        third = tensor(live, path, batch, **heads)
        assert third.status_code == 429, third.text
        assert third.headers["content-type"].startswith(PROBLEM)
        online = live.client.post(path, json={"instances": [X] * 4})
        assert online.status_code == 200, online.text
        assert all(f.result().status_code == 200 for f in running)


def test_the_batch_lane_names_the_replicas_a_worker_may_post_to(live: Live) -> None:
    live.register("mlp", "1")
    deploy(live, "mlp", max_batch_size=8, placement={"threads": 1})
    # the local backend starts the replica with the placement's model threads
    (replica,) = live.ready("mlp")
    argv = Path(f"/proc/{replica['pid']}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--threads") + 1] == b"1"
    lane = live.client.post("/v1/models/mlp/versions/1:batch-lane", json={"sent": 0})
    assert lane.status_code == 200, lane.text
    doc = lane.json()
    assert doc["model"] == "mlp" and doc["version"] == "1" and doc["max_batch_size"] == 8
    assert {r["url"] for r in doc["replicas"]} == {r["url"] for r in live.ready("mlp")}
    assert all(r["window"] == 32 for r in doc["replicas"])  # the replica's 4 batches of 8
    # there, a tensor in and a tensor out, from the version asked for
    body = TensorBody.of(np.ones((8, 256), np.float32))
    headers = {"content-type": body.content_type, "x-ember-priority": "batch",
               "accept": MEDIA_TYPE}  # fmt: skip
    target = doc["replicas"][0]
    # with the replica's secret, which the lane hands out (a worker's or admin's key only)
    refused = httpx.post(f"{target['url']}/infer", content=body.data, headers=headers)
    assert refused.status_code == 401
    auth = {REPLICA_SECRET_HEADER: target["secret"]}
    direct = httpx.post(f"{target['url']}/infer", content=body.data, headers=headers | auth)
    assert direct.status_code == 200 and direct.headers["x-ember-version"] == "1"
    assert direct.headers["content-type"].startswith(f"{MEDIA_TYPE}; dtype=float64; shape=8,16")
    for path, payload, status in [
        ("/v1/models/mlp/versions/9:batch-lane", {}, 404),  # a version it does not serve
        ("/v1/models/nope/versions/1:batch-lane", {}, 404),
        ("/v1/models/mlp/versions/1:batch-lane", {"sent": -1}, 422),
        ("/v1/models/mlp/versions/1:batch-lane", {"sent": "many"}, 422),
        ("/v1/models/mlp/versions/1:batch-lane", {"sent": 1, "extra": 2}, 422),
    ]:
        answer = live.client.post(path, json=payload)
        assert answer.status_code == status, (path, payload, answer.text)
        assert answer.headers["content-type"] == PROBLEM
    broken = live.client.post(
        "/v1/models/mlp/versions/1:batch-lane",
        content=b'{"sent": ',
        headers={"content-type": "application/json"},
    )
    assert broken.status_code in (400, 422) and broken.headers["content-type"] == PROBLEM
    anonymous = httpx.post(f"{live.client.base_url}/v1/models/mlp/versions/1:batch-lane", json={})
    assert anonymous.status_code == 401


def test_the_batch_lane_reports_what_was_sent_and_leaves_out_what_cannot_serve() -> None:
    """In process: the instances a worker sent directly are the autoscaler's demand; an
    ejected replica, a warm one and another version's are not in the lane; with none
    ready the lane is empty (and a replica is asked for)."""
    controller = PoolsController(None, FakeBackend(), standby_pool=0)  # type: ignore[arg-type]
    specs = {
        v: VersionSpec(
            model="mlp", version=v, artifact_uri="file:///mlp", sha256="", engine="torch"
        )
        for v in ("1", "2")
    }
    view = DeploymentView(1, "mlp", "mlp", {"1": 100}, PoolPolicy(max_batch_size=16), specs, [])
    controller.deployments[(1, "mlp")] = view
    for rid, version, tier, ejected in [
        ("hot", "1", "hot", 0.0),
        ("ejected", "1", "hot", time.monotonic() + 60),
        ("warm", "1", "warm", 0.0),
        ("other", "2", "hot", 0.0),
    ]:
        url = f"http://127.0.0.1:1/{rid}"
        replica = ManagedReplica(ReplicaHandle(rid, url), (1, "mlp"), "mlp", version,
                                 state="ready", tier=tier)  # fmt: skip
        replica.route = Route(rid, url, version, ejected_until=ejected)
        controller.replicas[rid] = replica
    controller.publish()
    gateway = Gateway(controller, Admission(1e9, 1e9), 0.1)
    lane = gateway.batch_lane(view, "1", sent=40)
    assert [r["id"] for r in lane["replicas"]] == ["hot"] and lane["replicas"][0]["window"] == 64
    assert controller.demand[((1, "mlp"), "1")] == [40.0, 40.0]  # one unit a row, uncalibrated
    gateway.batch_lane(view, "1", sent=0)
    assert controller.demand[((1, "mlp"), "1")] == [40.0, 40.0]
    del controller.replicas["hot"]
    controller.publish()
    assert gateway.batch_lane(view, "1", sent=0)["replicas"] == []
