"""`ember up` runs a supervised `ember beat` beside its worker; it dies with `ember up`."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx

from tests.jobs.conftest import EMBER
from tests.jobs.test_up_worker import alive
from tests.services import free_port, wait_until


def test_up_runs_a_beat(tmp_path: Path, redis_url: str) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | {
        "EMBER_DATA_DIR": str(tmp_path),
        "EMBER_PORT": str(port),
        "EMBER_REDIS_URL": redis_url,
        "EMBER_POOLS_ENABLED": "false",
        "EMBER_ADMIN_KEY": "ek_up-beat-test-key-0123456789",
        "EMBER_LOG_FORMAT": "json",
    }
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen([EMBER, "up"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200, 90, "ember up"
        )
        printed = re.search(r"beat:\s+pid (\d+)", log.read_text())
        assert printed, log.read_text()[-3000:]
        beat = int(printed.group(1))
        wait_until(lambda: "beat leads" in log.read_text(), 60, "the beat to lead")
        up.kill()
        up.wait(10)
        wait_until(lambda: not alive(beat), 60, "the orphaned beat to stop")
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
