"""Batching, priorities, deadlines, caps, tiers and logs of real replica processes."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx
import numpy as np

from tests.engine.conftest import StartEngine
from tests.services import wait_until

X = [0.25] * 256


def infer(url: str, n: int = 1, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/infer", json={"instances": [X] * n, **extra}, timeout=60)


def test_concurrent_requests_are_batched(
    start_engine: StartEngine, mlp_spec: dict[str, Any]
) -> None:
    engine = start_engine(mlp_spec, "--max-batch-size", "64", "--max-queue-delay-ms", "50")
    before = engine.metric("ember_forward_passes_total")
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(lambda _: infer(engine.url), range(32)))
    assert all(r.status_code == 200 for r in responses)
    first = responses[0].json()["predictions"][0]
    for r in responses:  # same input, same output (up to batch-size-dependent rounding)
        assert np.allclose(r.json()["predictions"][0], first, rtol=1e-4, atol=1e-6)
    passes = engine.metric("ember_forward_passes_total") - before
    assert 1 <= passes < 32 / 2, passes  # 32 requests shared far fewer forward passes
    assert engine.metric("ember_inferences_total") == 32
    assert (
        responses[0].headers["x-ember-model"] == "mlp"
        and responses[0].headers["x-ember-version"] == "1"
    )


def test_a_lone_request_does_not_wait_for_a_batch(
    start_engine: StartEngine, mlp_spec: dict[str, Any]
) -> None:
    """When requests arrive further apart than the batching delay, nothing else is
    expected within it: the batcher sends a lone request at once instead of holding it
    for the whole delay (here 3 s)."""
    engine = start_engine(mlp_spec, "--max-batch-size", "64", "--max-queue-delay-ms", "3000")
    for _ in range(2):
        started = time.monotonic()
        assert infer(engine.url).status_code == 200
        assert time.monotonic() - started < 2.0  # not held for the 3 s delay
        time.sleep(3.5)  # light load: arrivals further apart than the delay


def test_health_probe_jumps_a_full_queue_and_overflow_is_429(
    start_engine: StartEngine, slow_spec: dict[str, Any]
) -> None:
    # 2.5 s a forward pass: on a loaded machine the five requests may take over a second to
    # arrive, and the queue must still be full when the last one does.
    slower = dict(
        slow_spec, engine_config={**slow_spec["engine_config"], "kwargs": {"delay_s": 2.5}}
    )
    engine = start_engine(
        slower, "--max-batch-size", "1", "--max-queue", "4", "--max-queue-delay-ms", "0"
    )
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        queued = [pool.submit(infer, engine.url) for _ in range(5)]  # 1 computing + 4 queued
        wait_until(
            lambda: engine.metric("ember_queue_depth", priority="online") == 4, 30, "full queue"
        )
        overflow = infer(engine.url)
        probe = httpx.get(f"{engine.url}/healthz", timeout=30)
        still_queued = httpx.get(f"{engine.url}/info").json()["queued"]
        assert all(f.result().status_code == 200 for f in queued)
    assert probe.status_code == 200
    assert still_queued >= 2  # the probe was answered ahead of online work queued before it
    assert overflow.status_code == 429
    body = overflow.json()
    assert body["queued"] == 4 and body["max_queued"] == 4 and body["priority"] == "online"
    assert int(overflow.headers["retry-after"]) >= 1


def test_expired_deadlines_are_dropped_before_compute(
    start_engine: StartEngine, slow_spec: dict[str, Any]
) -> None:
    slower = dict(
        slow_spec, engine_config={**slow_spec["engine_config"], "kwargs": {"delay_s": 2.0}}
    )
    engine = start_engine(slower, "--max-batch-size", "1", "--max-queue-delay-ms", "0")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        blocker = pool.submit(infer, engine.url, 1)
        wait_until(
            lambda: httpx.get(f"{engine.url}/info").json()["inflight_units"] > 0, 30, "blocker"
        )
        late = [pool.submit(infer, engine.url, 1, timeout_ms=200) for _ in range(3)]
        assert blocker.result().status_code == 200
        results = [f.result() for f in late]
    assert all(r.status_code == 504 for r in results)
    assert results[0].json()["type"].endswith("/deadline-exceeded")
    time.sleep(0.5)
    assert engine.metric("ember_inferences_total") == 1  # the expired ones cost no compute


def test_caps_and_bad_instances(start_engine: StartEngine, mlp_spec: dict[str, Any]) -> None:
    engine = start_engine(mlp_spec, "--max-input-size", "100")
    too_big = infer(engine.url)
    assert too_big.status_code == 413 and too_big.json()["max_input_size"] == 100
    engine2 = start_engine(mlp_spec)
    wrong = httpx.post(f"{engine2.url}/infer", json={"instances": [[1, 2, 3]]})
    assert wrong.status_code == 422 and "shape" in wrong.json()["detail"]
    text = httpx.post(f"{engine2.url}/infer", json={"instances": ["hello"]})
    assert text.status_code == 422
    malformed = httpx.post(
        f"{engine2.url}/infer", content=b"{", headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 400
    bad_priority = infer(engine2.url, priority="urgent")
    assert bad_priority.status_code == 422
    assert infer(engine2.url, priority="health").status_code == 422
    assert infer(engine2.url, 3, priority="batch").status_code == 200


def test_tier_round_trips_give_identical_outputs(
    start_engine: StartEngine, mlp_spec: dict[str, Any]
) -> None:
    engine = start_engine(mlp_spec)
    reference = infer(engine.url, 2).json()["predictions"]
    for tier in ("warm", "standby"):
        assert httpx.post(f"{engine.url}/tier", json={"tier": tier}).json()["tier"] == tier
        assert httpx.get(f"{engine.url}/readyz").status_code == 503
        refused = infer(engine.url)
        assert refused.status_code == 503 and refused.json()["type"].endswith("/not-ready")
        assert httpx.get(f"{engine.url}/healthz").status_code == 200  # alive, just not hot
        assert httpx.post(f"{engine.url}/tier", json={"tier": "hot"}).json()["tier"] == "hot"
        assert infer(engine.url, 2).json()["predictions"] == reference
    assert httpx.post(f"{engine.url}/tier", json={"tier": "lukewarm"}).status_code == 422


def test_standby_process_is_assigned_a_version(
    start_engine: StartEngine, mlp_spec: dict[str, Any]
) -> None:
    engine = start_engine(None)
    assert httpx.get(f"{engine.url}/readyz").json() == {
        "ready": False,
        "state": "standby",
        "tier": "standby",
    }
    for bad in ({"max_batch_size": 0}, {"threads": "many"}, {"max_batch_sise": 8}):
        refused = httpx.post(f"{engine.url}/assign", json=mlp_spec, params=bad, timeout=60)
        assert refused.status_code == 422, (bad, refused.text)
        assert refused.headers["content-type"].startswith("application/problem+json")
    assert httpx.get(f"{engine.url}/info").json()["state"] == "standby"  # nothing half-done
    # the deployment's batch policy and threads come with the version
    policy = {"max_batch_size": 7, "max_queue_delay_ms": 1.5, "max_queue": 99, "threads": 1}
    assigned = httpx.post(f"{engine.url}/assign", json=mlp_spec, params=policy, timeout=60)
    assert assigned.status_code == 200, assigned.text
    info = assigned.json()
    assert info["state"] == "ready"
    assert info["threads"] == 1
    assert {k: info["policy"][k] for k in policy if k != "threads"} == {
        "max_batch_size": 7,
        "max_queue_delay_ms": 1.5,
        "max_queue": 99,
    }
    assert infer(engine.url).status_code == 200
    again = httpx.post(f"{engine.url}/assign", json=mlp_spec)
    assert again.status_code == 409


def test_a_standby_process_reserves_memory_for_the_weights_and_a_load_takes_it(
    start_engine: StartEngine, mlp_spec: dict[str, Any]
) -> None:
    engine = start_engine(None, "--reserve-bytes", str(8 * 1024 * 1024))
    deadline = time.monotonic() + 30
    while not (info := httpx.get(f"{engine.url}/info").json())["reserve"]["ready"]:
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    assert info["reserve"]["bytes"] == 8 * 1024 * 1024
    assigned = httpx.post(f"{engine.url}/assign", json=mlp_spec, timeout=60)
    assert assigned.status_code == 200, assigned.text
    assert assigned.json()["reserve"] == {"bytes": 0, "ready": False}  # taken or given back
    assert infer(engine.url).status_code == 200


def test_every_log_line_carries_model_version_and_replica(
    start_engine: StartEngine, mlp_spec: dict[str, Any]
) -> None:
    engine = start_engine(mlp_spec, "--replica-id", "r-test")
    assert infer(engine.url).status_code == 200
    assert infer(engine.url, priority="bogus").status_code == 422
    lines = engine.lines()
    assert len(lines) >= 3
    for line in lines:
        assert line.get("model") == "mlp" and line.get("version") == "1", line
        assert line.get("replica_id") == "r-test", line


def test_a_corrupt_artifact_fails_the_replica_clearly(
    start_engine: StartEngine, mlp_spec: dict[str, Any]
) -> None:
    bad = dict(mlp_spec, sha256="0" * 64)
    engine = start_engine(bad, ready=False)
    deadline = time.monotonic() + 30
    while (
        httpx.get(f"{engine.url}/info").json()["state"] == "loading" and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    info = httpx.get(f"{engine.url}/info").json()
    assert info["state"] == "failed" and "sha256" in info["failure"].lower()
    assert httpx.get(f"{engine.url}/healthz").status_code == 503
    assert infer(engine.url).status_code == 503


def test_what_a_replica_keeps_is_frozen_out_of_the_gc(
    start_engine: StartEngine, mlp_spec: dict[str, Any]
) -> None:
    """The runtime imported at the start and the engine an assignment loads are frozen (no
    later full collection walks them, ember.engine.heap), and the GC runs again after each
    phase — also after a load that failed."""
    engine = start_engine(None)
    started = httpx.get(f"{engine.url}/info").json()["gc"]
    assert started["enabled"] and started["frozen"] > 0, started
    assigned = httpx.post(f"{engine.url}/assign", json=mlp_spec, timeout=60)
    assert assigned.status_code == 200, assigned.text
    loaded = assigned.json()["gc"]
    assert loaded["enabled"], loaded
    assert loaded["frozen"] > started["frozen"], (started, loaded)  # the model's objects

    broken = start_engine(None)
    wrong = mlp_spec | {"sha256": "0" * 64}  # the load refuses the artifact
    httpx.post(f"{broken.url}/assign", json=wrong, timeout=60)
    info = httpx.get(f"{broken.url}/info").json()
    assert info["state"] == "failed", info
    assert info["gc"]["enabled"], info
