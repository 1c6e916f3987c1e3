"""Embedded defaults for one machine: a local Redis that Ember starts when none is set."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from ember.config import Settings
from ember.errors import CapacityError
from ember.logs import get_logger

log = get_logger(__name__)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def ensure_redis(settings: Settings) -> str:
    """``EMBER_REDIS_URL`` if set; otherwise a Redis under the data directory (started
    once, reused by later starts, persisted with AOF so queued jobs survive restarts)."""
    if settings.redis_url:
        return settings.redis_url
    port = settings.local_redis_port
    url = f"redis://127.0.0.1:{port}/0"
    if _answers(port):
        return url
    exe = shutil.which("redis-server")
    if exe is None:
        raise CapacityError(
            "no EMBER_REDIS_URL and no redis-server on PATH: run `make up` (it installs one) "
            "or set EMBER_REDIS_URL"
        )
    workdir: Path = settings.data_dir / "redis"
    workdir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
         "--appendonly", "yes", "--save", "", "--daemonize", "yes",
         "--pidfile", str(workdir / "redis.pid"), "--logfile", str(workdir / "redis.log")],
        check=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not _answers(port):
        if time.monotonic() > deadline:
            raise CapacityError(f"local redis did not start; see {workdir / 'redis.log'}")
        time.sleep(0.1)
    log.info("started local redis", url=url, dir=str(workdir))
    return url
