"""Two real API processes (`ember serve`) on one real Redis and one registry, each with
its pools controller and its real `ember engine` replicas (the local backend: each API
process acts on the replicas it launched, so each replica is counted by exactly the one
controller that acts on it — on a cluster that is the Lease holder)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.gateway.conftest import Live
from tests.jobs.conftest import RedisProc

EMBER = str(Path(sys.executable).with_name("ember"))
X = [0.5] * 256


@dataclass
class ApiProc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    live: Live

    @property
    def client(self) -> httpx.Client:
        return self.live.client

    def cost(self, deployment: str) -> dict[str, Any]:
        answer = self.client.get(f"/v1/deployments/{deployment}/cost")
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.live.client.close()


@dataclass
class TwoApis:
    data_dir: Path
    redis: RedisProc
    apis: list[ApiProc] = field(default_factory=list)

    def start(self, name: str, **env: str) -> ApiProc:
        port = services.free_port()
        log = self.data_dir.parent / f"api-{name}.log"
        full = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
        full |= {
            "EMBER_DATA_DIR": str(self.data_dir),
            "EMBER_ADMIN_KEY": ADMIN_KEY,
            "EMBER_REDIS_URL": self.redis.url,
            "EMBER_HOST": "127.0.0.1",
            "EMBER_PORT": str(port),
            "EMBER_STANDBY_REPLICAS": "0",
            "EMBER_LOG_FORMAT": "json",
            **env,
        }
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [EMBER, "serve"], env=full, stdout=out, stderr=subprocess.STDOUT
            )
        url = f"http://127.0.0.1:{port}"
        client = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )
        api = ApiProc(name, proc, log, Live(url, client, self.data_dir / "objects"))
        self.apis.append(api)

        def up() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        services.wait_until(up, 120, f"API {name}")
        return api


@dataclass
class Deployed:
    """API ``a`` and ``b``, each with one ready replica of ``mlp`` version 1."""

    a: ApiProc
    b: ApiProc
    data_dir: Path


@pytest.fixture(scope="package")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    tmp = tmp_path_factory.mktemp("two-apis")
    data_dir = tmp / "ember-data"
    data_dir.mkdir()
    redis = RedisProc(tmp)
    redis.start()
    platform = TwoApis(data_dir, redis)
    try:
        a = platform.start("a")
        a.live.register("mlp", "1")
        created = a.client.post("/v1/deployments", json={"model": "mlp", "version": "1"})
        assert created.status_code == 201, created.text
        a.live.wait(lambda: len(a.live.ready("mlp")) == 1, "a's replica of mlp")
        b = platform.start("b")  # after a: the registry is migrated, the model is there
        b.live.wait(lambda: len(b.live.ready("mlp")) == 1, "b's replica of mlp")
        yield Deployed(a, b, data_dir)
    finally:
        for api in reversed(platform.apis):
            api.stop()
        redis.kill()
