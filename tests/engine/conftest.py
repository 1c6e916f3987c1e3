"""Real `ember engine` processes serving real torch models."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.engine.examples.mlp import (
    ENGINE_CONFIG,
    INPUT_SCHEMA,
    build_mlp_artifact,
    build_slow_mlp_artifact,
)
from tests.services import free_port, wait_until

EMBER = str(Path(sys.executable).with_name("ember"))


@dataclass
class EngineProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                head = line.split(" ")[0]
                if head.split("{")[0] == name:
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.log.read_text().splitlines() if x.startswith("{")]


def spec_for(path: Path, model: str, version: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "version": version, "artifact_uri": path.as_uri(),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), **extra}  # fmt: skip


@pytest.fixture
def mlp_spec(data_dir: Path) -> dict[str, Any]:
    path = build_mlp_artifact(data_dir / "objects" / "mlp" / "1" / "model.safetensors")
    return spec_for(
        path, "mlp", "1", engine="torch", engine_config=ENGINE_CONFIG, input_schema=INPUT_SCHEMA
    )


@pytest.fixture
def slow_spec(data_dir: Path) -> dict[str, Any]:
    path = build_slow_mlp_artifact(data_dir / "objects" / "slow" / "1" / "model.safetensors")
    config = {"factory": "ember.engine.examples.mlp:slow_mlp", "kwargs": {"delay_s": 0.3}}
    return spec_for(
        path, "slow", "1", engine="torch", engine_config=config, input_schema=INPUT_SCHEMA
    )


StartEngine = Callable[..., EngineProcess]


@pytest.fixture
def start_engine(data_dir: Path, tmp_path: Path) -> Iterator[StartEngine]:
    procs: list[EngineProcess] = []

    def start(spec: dict[str, Any] | None, *args: str, ready: bool = True) -> EngineProcess:
        port = free_port()
        cmd = [EMBER, "engine", "--port", str(port), *args]
        if spec is None:
            cmd.append("--standby")
        else:
            spec_file = tmp_path / f"spec-{port}.json"
            spec_file.write_text(json.dumps(spec))
            cmd += ["--spec-file", str(spec_file)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
        env |= {"EMBER_DATA_DIR": str(data_dir), "EMBER_LOG_FORMAT": "json"}
        log = tmp_path / f"engine-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        engine = EngineProcess(f"http://127.0.0.1:{port}", proc, log)
        procs.append(engine)
        path = "/readyz" if ready and spec is not None else "/info"  # /info answers in any state
        wait_until(
            lambda: httpx.get(engine.url + path).status_code == 200,
            90,
            f"engine ({log.read_text()[-2000:]})",
        )
        return engine

    yield start
    for engine in procs:
        engine.proc.terminate()
        try:
            engine.proc.wait(15)
        except subprocess.TimeoutExpired:
            engine.proc.kill()
