"""`ember up` as a newcomer runs it: embedded defaults, a printed key, data kept across restarts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.services import free_port, wait_until

EMBER = str(Path(sys.executable).with_name("ember"))


@contextmanager
def ember_up(env: dict[str, str]) -> Iterator[tuple[str, list[str]]]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | env
    proc = subprocess.Popen(
        [EMBER, "up"], env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{env['EMBER_PORT']}"
    output: list[str] = []
    try:

        def ready() -> bool:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200

        wait_until(ready, 60, "ember up")
        yield url, output
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        output.append(out)


def test_up_prints_a_key_starts_redis_and_keeps_data(tmp_path: Path) -> None:
    redis_port = free_port()
    env = {
        "EMBER_STANDBY_REPLICAS": "0",
        "EMBER_DATA_DIR": str(tmp_path / "data"),
        "EMBER_PORT": str(free_port()),
        "EMBER_LOCAL_REDIS_PORT": str(redis_port),
    }
    with ember_up(env) as (url, output):
        pass
    first = output[0]
    assert f"Ember {url}" in first
    assert f"redis:    127.0.0.1:{redis_port}/0" in first  # the URL without its password
    assert "example:  minilm:1 pushed" in first
    key = re.search(r"export EMBER_API_KEY=(\S+)", first)
    assert key, first
    headers = {"Authorization": f"Bearer {key.group(1)}"}
    with ember_up(env) as (url, output):
        assert (
            httpx.post(f"{url}/v1/models", json={"name": "kept"}, headers=headers).status_code
            == 201
        )
    assert "export EMBER_API_KEY" not in output[0]  # shown once
    with ember_up(env) as (url, _):

        def answers() -> bool:
            body = {"instances": ["a sentence to embed"]}
            r = httpx.post(
                f"{url}/v1/models/minilm:predict", json=body, headers=headers, timeout=30
            )
            return r.status_code == 200 and len(r.json()["predictions"][0]) == 384

        wait_until(answers, 240, "minilm predictions after ember up")
        listed = httpx.get(f"{url}/v1/models", headers=headers).json()
        assert [m["name"] for m in listed["items"]] == ["minilm", "kept"]
        deployed = httpx.get(f"{url}/v1/deployments/minilm", headers=headers).json()
        assert deployed["aliases"] == {"production": "1"} and deployed["min_hot"] == 1
        version = httpx.get(f"{url}/v1/models/minilm/versions/1", headers=headers).json()
        assert version["status"] == "ready" and version["tensor_count"] == 104
    assert (tmp_path / "data" / "registry.db").exists()
    # The data directory's own Redis: its password and port kept there; stopped with
    # `ember up` (tests/security/test_small_holes.py checks the rest).
    assert (tmp_path / "data" / "redis" / "password").exists()
    assert (tmp_path / "data" / "redis" / "port").read_text().strip() == str(redis_port)
    assert not (tmp_path / "data" / "redis" / "redis.pid").exists()  # removed as it stopped


def test_configured_admin_key_is_the_admin_key(tmp_path: Path, redis_url: str) -> None:
    key = "ek_scripted-setup-key-123456"
    env = {
        "EMBER_DATA_DIR": str(tmp_path),
        "EMBER_PORT": str(free_port()),
        "EMBER_ADMIN_KEY": key,
        "EMBER_REDIS_URL": redis_url,
        "EMBER_POOLS_ENABLED": "false",
    }
    with ember_up(env) as (url, output):
        whoami = httpx.get(f"{url}/v1/whoami", headers={"Authorization": f"Bearer {key}"})
        assert whoami.json() == {"tenant": "default", "scope": "admin"}
    assert "EMBER_API_KEY=" not in output[0]
