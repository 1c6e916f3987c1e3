"""A live platform for the async regime: a real API with the pools controller and an
`ember engine` replica of the slow MLP example, a real Redis (restartable, without
persistence: a restart loses every message) and real `ember worker` processes.

One platform for the package (starting replicas and workers is the slow part); each
test submits its own jobs, and the tests that break things (SIGKILL, Redis restart) run
last.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from ember.api.app import create_app
from ember.config import Settings
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.gateway.conftest import Live, deploy

EMBER = str(Path(sys.executable).with_name("ember"))
MODEL = "slow"
DELAY_S = 0.25
X = [0.5] * 256
FINISHED = ("succeeded", "failed", "cancelled")

#: What the API and the workers share; short leases and sweeps so that recovery from a
#: killed worker or a lost Redis takes seconds, not minutes.
JOBS = {
    "jobs_lease_s": 2.0,
    "jobs_sweep_interval_s": 0.5,
    "jobs_republish_after_s": 20.0,
    "jobs_retry_base_s": 0.2,
    "jobs_retry_max_backoff_s": 1.5,
    "jobs_timeout_s": 60.0,
    "jobs_visibility_timeout_s": 90.0,
    "jobs_inline_result_max_bytes": 1024,
    "jobs_max_attempts": 6,
    "jobs_webhook_allow_private": True,
    "jobs_tenant_max_queued_units": 2000.0,
}


class RedisProc:
    """A redis-server we can kill and start again on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = services.free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: run `make test` (it installs it)")
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
        )
        services.wait_until(lambda: _pong(self.port), 15, "redis")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


def _pong(port: int) -> bool:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(16).startswith(b"+PONG")


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class Platform:
    app: Any
    live: Live
    settings: Settings
    redis: RedisProc
    env: dict[str, str]
    tmp: Path
    workers: list[Worker] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: int = 0

    @property
    def client(self) -> httpx.Client:
        return self.live.client

    def start_worker(self, **env: str) -> Worker:
        with self.lock:
            self.started += 1
            log = self.tmp / f"worker-{self.started}.log"
        full = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
        proc = subprocess.Popen(
            [EMBER, "worker"],
            env=full | self.env | env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        worker = Worker(proc, log)
        with self.lock:
            self.workers.append(worker)
        services.wait_until(
            lambda: b"ready" in log.read_bytes() or not worker.alive(), 60, "the job worker"
        )
        assert worker.alive(), log.read_text()[-3000:]
        return worker

    def live_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.alive()]

    def kill(self, worker: Worker) -> None:
        os.kill(worker.pid, signal.SIGKILL)
        worker.proc.wait(10)

    def submit(self, instances: list[Any] | None = None, **body: Any) -> httpx.Response:
        headers = body.pop("headers", {})
        body.setdefault("model", MODEL)
        if instances is not None:
            body["inputs"] = {"instances": instances}
        return self.client.post("/v1/jobs", json=body, headers=headers)

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.client.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def wait(
        self,
        job_id: str,
        until: Callable[[dict[str, Any]], bool] | None = None,
        timeout_s: float = 90,
    ) -> dict[str, Any]:
        check = until or (lambda j: j["status"] in FINISHED)
        last: dict[str, Any] = {}

        def done() -> bool:
            nonlocal last
            last = self.job(job_id)
            return check(last)

        try:
            services.wait_until(done, timeout_s, f"job {job_id}")
        except RuntimeError as exc:
            raise AssertionError(f"{exc}: {last}\n{self.worker_logs()}") from exc
        return last

    def worker_logs(self, tail: int = 4000) -> str:
        return "\n".join(f"--- {w.log.name}\n{w.log.read_text()[-tail:]}" for w in self.workers)

    def online(self, n: int = 1) -> list[Any]:
        response = self.live.predict(MODEL, n, timeout_ms=30_000)
        assert response.status_code == 200, response.text
        return list(response.json()["predictions"])


def job_settings(data_dir: Path, redis_url: str, **extra: Any) -> Settings:
    return Settings(
        data_dir=data_dir,
        admin_key=ADMIN_KEY,  # type: ignore[arg-type]
        redis_url=redis_url,
        standby_replicas=0,
        **(JOBS | extra),
    )


def worker_env(settings: Settings, api_url: str) -> dict[str, str]:
    env = {f"EMBER_{k.upper()}": str(v) for k, v in JOBS.items()}
    return env | {
        "EMBER_DATA_DIR": str(settings.data_dir),
        "EMBER_REDIS_URL": settings.redis_url or "",
        "EMBER_JOBS_API_URL": api_url,
        "EMBER_JOBS_API_KEY": ADMIN_KEY,
        "EMBER_JOBS_WORKER_CONCURRENCY": "4",
        "EMBER_LOG_FORMAT": "json",
    }


P = TypeVar("P", bound="Platform")


@contextmanager
def live_platform(
    kind: type[P],
    tmp: Path,
    model: str,
    delay_s: float,
    max_batch_size: int,
    settings_extra: dict[str, Any] | None = None,
    env_extra: dict[str, str] | None = None,
) -> Iterator[P]:
    """The API with one replica of the slow MLP ``model`` (versions 1 and 2; a forward pass
    takes ``delay_s``), a Redis of its own and two real ``ember worker`` processes."""
    data_dir = tmp / "data"
    data_dir.mkdir()
    redis = RedisProc(tmp)
    redis.start()
    settings = job_settings(data_dir, redis.url, **(settings_extra or {}))
    app = create_app(settings)
    try:
        with services.serve_app(app) as url:
            client = httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
            )
            live = Live(url, client, data_dir / "objects")
            # the workers hold a worker key, as `ember up`'s do (the data plane only)
            minted = client.post("/v1/keys", json={"name": "workers", "scope": "worker"})
            assert minted.status_code == 201, minted.text
            env = worker_env(settings, url) | {"EMBER_JOBS_API_KEY": minted.json()["key"]}
            env |= env_extra or {}
            platform = kind(app, live, settings, redis, env, tmp)
            starting = [threading.Thread(target=platform.start_worker) for _ in range(2)]
            for thread in starting:  # workers start while the replica loads
                thread.start()
            live.register(model, "1", slow_s=delay_s)
            live.register(model, "2", slow_s=delay_s)
            policy = {"max_batch_size": max_batch_size, "max_queue_delay_ms": 0}
            deploy(live, model, min_hot=1, max_replicas=1, **policy)
            for thread in starting:
                thread.join()
            assert len(platform.live_workers()) == 2, platform.worker_logs()
            try:
                yield platform
            finally:
                for worker in platform.live_workers():
                    worker.proc.send_signal(signal.SIGTERM)
                for worker in platform.workers:
                    try:
                        worker.proc.wait(20)
                    except subprocess.TimeoutExpired:
                        worker.proc.kill()
                client.close()
    finally:
        redis.kill()


@pytest.fixture(scope="package")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """API + one replica of `slow` (a forward pass takes DELAY_S; max_batch_size 4, so a
    job runs in chunks of 2) + two workers."""
    tmp = tmp_path_factory.mktemp("jobs")
    with live_platform(Platform, tmp, MODEL, DELAY_S, max_batch_size=4) as platform:
        yield platform


def since(t0: float) -> float:
    return time.monotonic() - t0
