"""`ember up` runs one job worker and starts another whenever it dies."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import httpx

from tests.jobs.conftest import EMBER
from tests.services import free_port, wait_until


def worker_children(parent: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == parent and b"worker" in cmdline:
            found.add(int(stat.parent.name))
    return found


def test_up_supervises_one_worker(tmp_path: Path, redis_url: str) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | {
        "EMBER_DATA_DIR": str(tmp_path),
        "EMBER_PORT": str(port),
        "EMBER_REDIS_URL": redis_url,
        "EMBER_POOLS_ENABLED": "false",
        "EMBER_ADMIN_KEY": "ek_up-worker-test-key-0123456",
    }
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen([EMBER, "up"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200, 90, "ember up"
        )
        printed = re.search(r"worker:\s+pid (\d+)", log.read_text())
        assert printed, log.read_text()[-3000:]
        first = int(printed.group(1))
        assert worker_children(up.pid) == {first}
        wait_until(
            lambda: f"ember@{socket.gethostname()}:{first} ready" in log.read_text(),
            60,
            "the worker to be ready",
        )

        os.kill(first, signal.SIGKILL)
        wait_until(lambda: bool(worker_children(up.pid) - {first}), 60, "a new worker")
        (second,) = worker_children(up.pid)
        assert second != first
        assert "job worker exited; starting another" in log.read_text()
        # `ember up` killed outright: its worker stops too (no orphan holding a stale key).
        up.kill()
        up.wait(10)
        wait_until(lambda: not alive(second), 60, "the orphaned worker to stop")
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
