"""Scale to warm, then to zero, for a deployment that opted out of the hot floor; the next
request wakes it (real `ember engine` processes, a standby one taking the version)."""

from __future__ import annotations

from pathlib import Path

from .conftest import live_api


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

        # Scaled to zero: the next request (with a deadline long enough for a start from
        # the standby process) wakes it instead of being refused.
        live.wait(
            lambda: 'deployment="(standby)",state="standby"' in client.get("/metrics").text,
            "a ready standby process",
            120,
        )
        woken = live.predict("mlp", timeout_ms=120_000)
        assert woken.status_code == 200, woken.text
        assert woken.headers["x-ember-version"] == "1"
        assert [e for e in live.events("mlp") if e["event"] == "assigned"]
        # A request without the time to wait gets a clear refusal, never a hang: the
        # deployment is hot again now, so it is served.
        assert live.predict("mlp", timeout_ms=5_000).status_code == 200
        # Scaling down stopped replicas; none of it counts as a failure (three would mark
        # the version crash-looping and stop its scale-ups).
        assert not [e for e in live.events("mlp") if e["event"] == "failed"]
