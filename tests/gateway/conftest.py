"""A live API with the pools controller: real `ember engine` replicas behind the gateway."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.api.app import create_app
from ember.config import Settings
from ember.engine.examples.mlp import INPUT_SCHEMA, build_mlp_artifact, build_slow_mlp_artifact
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.services import replica_secret_headers

X = [0.5] * 256


@dataclass
class Live:
    url: str
    client: httpx.Client
    store: Path

    def replicas(self, deployment: str) -> list[dict[str, Any]]:
        return list(self.client.get(f"/v1/deployments/{deployment}/replicas").json()["replicas"])

    def events(self, deployment: str) -> list[dict[str, Any]]:
        return list(self.client.get(f"/v1/deployments/{deployment}/replicas").json()["events"])

    def ready(self, deployment: str, version: str | None = None) -> list[dict[str, Any]]:
        return [
            r
            for r in self.replicas(deployment)
            if r["state"] == "ready" and (version is None or r["version"] == version)
        ]

    def wait(self, check: Callable[[], bool], what: str, timeout_s: float = 180) -> None:
        services.wait_until(check, timeout_s, what)

    def register(self, model: str, version: str, slow_s: float | None = None) -> Path:
        self.client.post("/v1/models", json={"name": model})
        path = self.store / model / version / "model.safetensors"
        if slow_s is None:
            build_mlp_artifact(path, seed=int(version))
            config: dict[str, Any] = {"factory": "ember.engine.examples.mlp:mlp", "kwargs": {}}
        else:
            build_slow_mlp_artifact(path, seed=int(version))
            config = {
                "factory": "ember.engine.examples.mlp:slow_mlp",
                "kwargs": {"delay_s": slow_s},
            }
        body = {
            "version": version,
            "artifact_uri": path.as_uri(),
            "engine": "torch",
            "engine_config": config,
            "input_schema": INPUT_SCHEMA,
        }
        created = self.client.post(f"/v1/models/{model}/versions", json=body)
        assert created.status_code == 201, created.text
        return path

    def predict(self, model: str, n: int = 1, **extra: Any) -> httpx.Response:
        headers = extra.pop("headers", {})
        return self.client.post(
            f"/v1/models/{model}:predict", json={"instances": [X] * n, **extra}, headers=headers
        )


@contextlib.contextmanager
def live_api(data_dir: Path, **settings: Any) -> Iterator[Live]:
    """A live API (pools on) on ``data_dir`` with an admin client; ``settings`` override."""
    config = Settings(data_dir=data_dir, admin_key=ADMIN_KEY, **settings)
    with services.serve_app(create_app(config)) as url:
        client = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )
        try:
            yield Live(url, client, data_dir / "objects")
        finally:
            client.close()


@pytest.fixture
def live(data_dir: Path) -> Iterator[Live]:
    with live_api(
        data_dir, standby_replicas=0, probe_idle_s=0.5, probe_timeout_s=1.0, probe_failures=2
    ) as api:
        yield api


def deploy(live: Live, model: str, version: str = "1", **policy: Any) -> None:
    created = live.client.post(
        "/v1/deployments", json={"model": model, "version": version, **policy}
    )
    assert created.status_code == 201, created.text
    want = policy.get("min_hot", 1)
    live.wait(lambda: len(live.ready(model)) >= want, f"{want} ready replicas of {model}")


def replica_auth(replica: dict[str, Any]) -> dict[str, str]:
    """The header that authenticates a call to a live replica's API."""
    return replica_secret_headers(replica["pid"])


def since(t0: float) -> float:
    return time.monotonic() - t0
