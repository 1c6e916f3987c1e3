"""Scale to warm, then to zero, for a deployment that opted out of the hot floor; the next
request wakes it (real `ember engine` processes, a standby one taking the version)."""

from __future__ import annotations

from pathlib import Path

import httpx

from ember.api.app import create_app
from ember.config import Settings
from tests import services
from tests.api.conftest import ADMIN_KEY

from .conftest import Live


def test_idle_scale_to_zero_deployment_goes_warm_then_to_zero_and_a_request_wakes_it(
    data_dir: Path,
) -> None:
    settings = Settings(
        data_dir=data_dir,
        admin_key=ADMIN_KEY,
        standby_replicas=1,  # type: ignore[arg-type]
        scale_idle_hold_s=1.0,
        scale_warm_keep_s=15.0,
    )
    with services.serve_app(create_app(settings)) as url:
        client = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )
        live = Live(url, client, data_dir / "objects")
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
        metrics = client.get("/metrics").text
        assert 'ember_replicas{deployment="mlp"' not in metrics or "} 0.0" in metrics

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
        client.close()
