"""Scale to warm, then to zero, for a deployment that opted out of the hot floor; the next
request wakes it (real `ember engine` processes, a standby one taking the version) from
the shared warm tier: its weights held in host RAM while it had no replica."""

from __future__ import annotations

from pathlib import Path

from ember.config import Settings
from ember.loader import pagecache
from ember.loader.cache import CacheKey, WeightCache

from .conftest import live_api

STANDBY = 'deployment="(standby)",model="-",state="standby"'
"""A ready standby process in ``ember_replicas``."""


def test_idle_scale_to_zero_deployment_goes_warm_then_to_zero_and_a_request_wakes_it(
    data_dir: Path,
) -> None:
    with live_api(
        data_dir, standby_replicas=1, scale_idle_hold_s=1.0, scale_warm_keep_s=15.0
    ) as live:
        client = live.client
        live.register("mlp", "1")
        body = {"model": "mlp", "version": "1", "min_hot": 0, "scale_to_zero": True}
        assert client.post("/v1/deployments", json=body).status_code == 201
        # A first request wakes it even before it ever had a replica.
        first = live.predict("mlp", timeout_ms=120_000)
        assert first.status_code == 200, first.text

        def tiers() -> list[tuple[str, str]]:
            return [(r["state"], r["tier"]) for r in live.replicas("mlp")]

        # Idle: hot -> warm (one tier at a time), then, past the warm keep, nothing.
        live.wait(lambda: tiers() == [("ready", "warm")], "the idle replica to go warm", 60)
        live.wait(lambda: tiers() == [], "the warm replica to go after its keep", 60)

        # With no replica left, the shared warm tier holds its weights in host RAM: locked
        # in the page cache, a reclaim cannot take them.
        sha = client.get("/v1/models/mlp/versions/1").json()["sha256"]
        cached = WeightCache.from_settings(Settings(data_dir=data_dir)).weights_path(
            CacheKey("mlp", "1", sha, tenant=1)  # the default tenant's cache directory
        )
        live.wait(
            lambda: "ember_warm_set_versions 1.0" in client.get("/metrics").text,
            "the version held by the warm set",
            30,
        )
        pagecache.drop(cached)
        assert pagecache.resident_fraction(cached) == 1.0

        # Scaled to zero: the next request (with a deadline long enough for a start from
        # the standby process) wakes it instead of being refused.
        live.wait(
            lambda: STANDBY in client.get("/metrics").text,
            "a ready standby process",
            120,
        )
        woken = live.predict("mlp", timeout_ms=120_000)
        assert woken.status_code == 200, woken.text
        assert woken.headers["x-ember-version"] == "1"
        assigned = [e for e in live.events("mlp") if e["event"] == "assigned"]
        assert assigned and assigned[-1]["warm_set"] is True  # read from host RAM
        # Hot again: the replica has the weights, the warm set lets its copy go.
        live.wait(
            lambda: "ember_warm_set_versions 0.0" in client.get("/metrics").text,
            "the warm set to let the version go",
            30,
        )
        # A request without the time to wait gets a clear refusal, never a hang: the
        # deployment is hot again now, so it is served.
        assert live.predict("mlp", timeout_ms=5_000).status_code == 200
        # Scaling down stopped replicas; none of it counts as a failure (three would mark
        # the version crash-looping and stop its scale-ups).
        assert not [e for e in live.events("mlp") if e["event"] == "failed"]
