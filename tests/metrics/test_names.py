"""Metric names and types (issue 23 §3): every ``/metrics`` Ember serves — the API's (a
live platform after real traffic) and a replica's (on its API port with the secret, and on
its scrape port without) — parsed by ``prometheus_client``'s parser and held to
Prometheus' naming rules (``tests/metrics/lint.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ember.domain.spec import REPLICA_SECRET_ENV, REPLICA_SECRET_HEADER
from ember.engine.examples.mlp import ENGINE_CONFIG, INPUT_SCHEMA, build_mlp_artifact
from tests import services
from tests.gateway.conftest import replica_auth
from tests.metrics.conftest import ApiProc, Deployed, X
from tests.metrics.lint import lint, undocumented

EMBER = str(Path(sys.executable).with_name("ember"))
DEPLOYMENT_LABELS = {"tenant", "deployment", "model", "version"}


def _families(text: str) -> dict[str, tuple[str, list[dict[str, str]]]]:
    return {
        f.name: (f.type, [dict(s.labels) for s in f.samples])
        for f in text_string_to_metric_families(text)
    }


def test_the_lint_catches_what_it_is_for() -> None:
    """The rules fail on the mistakes they exist for (a lint that passes anything proves
    nothing)."""
    bad = "\n".join([
        "# HELP ember_requests Requests", "# TYPE ember_requests counter", "ember_requests 1",
        "# HELP ember_lag_total Lag", "# TYPE ember_lag_total gauge", "ember_lag_total 1",
        "# HELP ember_load_latency Load", "# TYPE ember_load_latency gauge",
        "ember_load_latency 1",
        "# HELP ember_fetch_milliseconds Fetch", "# TYPE ember_fetch_milliseconds gauge",
        "ember_fetch_milliseconds 1",
        "# HELP queue_depth Depth", "# TYPE queue_depth gauge", "queue_depth 1",
        "# HELP ember_up Up", "# TYPE ember_up gauge", 'ember_up{Version="1"} 1',
        "# HELP ember_busy Busy", "# TYPE ember_busy gauge", 'ember_busy{version="1"} 1',
        "# HELP ember_seen Seen", "# TYPE ember_seen gauge", 'ember_seen{deployment="d"} 1',
    ]) + "\n"  # fmt: skip
    problems = "\n".join(lint(bad))
    assert "counter sample ember_requests without _total" in problems
    assert "ember_lag_total (gauge): a running total that is not a counter" in problems
    assert "ember_load_latency (gauge): a duration without _seconds" in problems
    assert "ember_fetch_milliseconds (gauge): a unit other than the base unit" in problems
    assert "queue_depth (gauge): not snake_case with the ember_ prefix" in problems
    assert "label 'Version' is not snake_case" in problems
    assert "ember_busy (gauge): has version but not ('model',)" in problems
    assert "ember_seen (gauge): has deployment but not ('tenant', 'model')" in problems


def test_the_apis_metrics_follow_the_naming_rules(deployed: Deployed) -> None:
    for api in (deployed.a, deployed.b):
        answer = api.client.post("/v1/models/mlp:predict", json={"instances": [X]})
        assert answer.status_code == 200, answer.text

    def counted(api: ApiProc) -> bool:  # the ledger flushes to Redis every second
        families = _families(api.client.get("/metrics").text)
        return bool(families.get("ember_cost_successes", ("", []))[1])

    for api in (deployed.a, deployed.b):
        services.wait_until(lambda: counted(api), 30, f"{api.name}'s successes in the ledger")  # noqa: B023
        text = api.client.get("/metrics").text
        assert lint(text) == []
        assert undocumented(text) == []  # docs/reference/metrics.md describes every one
        families = _families(text)
        # running totals are counters, durations in seconds, every deployment series
        # labelled with tenant, deployment, model and version
        for name in ("ember_gateway_requests", "ember_replica_seconds",
                     "ember_cost_replica_seconds", "ember_cost_successes"):  # fmt: skip
            kind, samples = families[name]
            assert kind == "counter", name
            assert samples and all(set(s) >= DEPLOYMENT_LABELS for s in samples), name
        for name in ("ember_gateway_latency_seconds", "ember_cold_start_seconds"):
            kind, samples = families[name]
            assert kind == "histogram"
            assert samples and all(set(s) >= DEPLOYMENT_LABELS for s in samples), name
        kind, samples = families["ember_replicas"]
        assert kind == "gauge" and all(set(s) >= DEPLOYMENT_LABELS for s in samples)
        kind, samples = families["ember_cost_per_success_replica_seconds"]
        assert kind == "gauge"
        windows = {s["window"] for s in samples if s["deployment"] == "mlp"}
        assert windows == {"5m", "1h", "24h", "lifetime"}
        assert all(set(s) >= DEPLOYMENT_LABELS for s in samples)
        kind, _ = families["ember_prediction_log_records"]
        assert kind == "counter"


def test_a_replicas_metrics_follow_the_naming_rules(deployed: Deployed) -> None:
    replica = deployed.a.live.ready("mlp")[0]
    answer = httpx.get(f"{replica['url']}/metrics", headers=replica_auth(replica), timeout=30)
    assert answer.status_code == 200
    assert lint(answer.text) == []
    assert undocumented(answer.text) == []
    families = _families(answer.text)
    for name in ("ember_forward_passes", "ember_inferences"):
        kind, samples = families[name]
        assert kind == "counter" and samples
        assert all({"model", "version"} <= set(s) for s in samples)
    kind, _ = families["ember_request_latency_seconds"]
    assert kind == "histogram"


@pytest.fixture
def scraped_engine(data_dir: Path, tmp_path: Path) -> Iterator[tuple[str, int, str]]:
    """An ``ember engine`` of the MLP with ``EMBER_ENGINE_METRICS_PORT`` and a secret:
    (its URL, its scrape port, its secret)."""
    path = build_mlp_artifact(data_dir / "objects" / "mlp" / "1" / "model.safetensors")
    import hashlib

    spec = {"model": "mlp", "version": "1", "artifact_uri": path.as_uri(),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "engine": "torch",
            "engine_config": ENGINE_CONFIG, "input_schema": INPUT_SCHEMA}  # fmt: skip
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port, scrape, secret = services.free_port(), services.free_port(), "s" * 43
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env |= {"EMBER_DATA_DIR": str(data_dir), "EMBER_ENGINE_METRICS_PORT": str(scrape),
            REPLICA_SECRET_ENV: secret}  # fmt: skip
    log = tmp_path / "engine.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [EMBER, "engine", "--port", str(port), "--spec-file", str(spec_file)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        services.wait_until(
            lambda: httpx.get(f"{url}/readyz").status_code == 200, 90, log.read_text()[-2000:]
        )
        yield url, scrape, secret
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_replica_is_scrapable_on_its_metrics_port_without_the_secret(
    scraped_engine: tuple[str, int, str],
) -> None:
    url, scrape, secret = scraped_engine
    good = {REPLICA_SECRET_HEADER: secret}
    answer = httpx.post(f"{url}/infer", json={"instances": [X]}, headers=good, timeout=30)
    assert answer.status_code == 200, answer.text
    assert httpx.get(f"{url}/metrics").status_code == 401  # the replica port keeps its secret
    scraped = httpx.get(f"http://127.0.0.1:{scrape}/metrics", timeout=30)
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain")
    assert lint(scraped.text) == []
    kind, samples = _families(scraped.text)["ember_inferences"]
    assert kind == "counter"
    assert [s for s in samples if s == {"model": "mlp", "version": "1"}]
    # the same series as on the replica port, and nothing but /metrics there
    own = httpx.get(f"{url}/metrics", headers=good, timeout=30).text
    assert set(_families(own)) == set(_families(scraped.text))
    assert httpx.get(f"http://127.0.0.1:{scrape}/infer").status_code == 404
    assert httpx.post(f"http://127.0.0.1:{scrape}/metrics").status_code == 404
