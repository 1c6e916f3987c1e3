"""The security suite's platform: one real Ember, shared by the package, for attacks.

``platform`` (package scope) runs, as a deployment would:

- the API as its own process (``ember serve``, pools controller on), on a fresh
  PostgreSQL database, with a real Redis, and an S3 object store (moto) as its
  ``EMBER_OBJECT_STORE_URL`` (``s3://ember-security/store``);
- two tenants, ``alice`` and ``bob`` (:class:`Tenant`), each with a tenant key (and a
  spare one), a model ``<tenant>-clf`` whose version ``1`` (the MLP example,
  ``ember.engine.examples.mlp:mlp``) was pushed with ``ember models push`` under the
  tenant's key, a deployment of it with one ready ``ember engine`` replica (``min_hot``
  1, ``max_replicas`` 1), a job, a paused batch schedule ``<tenant>-nightly`` over a
  JSONL dataset under the tenant's batch prefix and one run of it;
- the admin key, a worker key (``{"scope": "worker"}``, minted by the admin, of the
  default tenant) and a tenant key of the default tenant (``default_key``).

Use it from any ``tests/security/test_*.py``::

    def test_bob_cannot_read_alices_model(platform: SecurityPlatform) -> None:
        bob = platform.client(platform.bob.key)
        assert bob.get(f"/v1/models/{platform.alice.model}").status_code == 404

``platform.client(key, act_as=None)`` is an ``httpx.Client`` on the API sending
``Authorization: Bearer <key>`` (none for ``key=None``) and ``X-Ember-Tenant: <act_as>``;
clients are cached per (key, act_as) and closed at the end, so do not close them.
``platform.admin`` is the admin's. ``platform.tenant("alice")`` gives the resources,
``platform.api_log()`` / ``platform.replica_logs()`` what the processes wrote (for
assertion messages), ``platform.cli_env(key)`` the environment for an ``ember`` CLI
command against it, ``platform.start_worker()`` an ``ember worker`` with the worker key
(none runs by default: jobs and runs stay queued).

A test that changes shared state (revokes a key, deletes a resource, sets quotas) must
undo it or work on resources it made itself: the other files run against the same
platform. Start-up takes under a minute (two replicas load), once per package (under
pytest-xdist: once per worker that runs a test asking for it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
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

EMBER = str(Path(sys.executable).with_name("ember"))
BUCKET = "ember-security"
STORE = f"s3://{BUCKET}/store"
X = [0.5] * 256
MLP_CONFIG = {"factory": "ember.engine.examples.mlp:mlp", "kwargs": {}}
INPUT_SCHEMA = {"shape": [256], "dtype": "float32"}
#: Generous per-tenant overrides, so the suite's own request volume never trips a quota
#: or the rate limit (the tests of quotas set their own).
QUOTAS = {"requests_per_s": 10_000.0, "batch_runs": 100, "queued_jobs": 10_000}


@dataclass
class Tenant:
    """A tenant and what it owns on the platform (all names contain the tenant's name)."""

    name: str
    key: str
    key_id: int
    key_prefix: str
    spare_key: str
    """A second tenant key (made by the tenant itself), for revocation tests."""
    spare_key_id: int
    spare_key_prefix: str
    model: str
    version: str
    deployment: str
    artifact_uri: str
    job_id: str
    schedule: str
    run_id: str
    batch_prefix: str
    """``s3://…/batch/<tenant>/``: where the tenant's batch data lives."""
    input_uri: str
    output_uri: str


@dataclass
class SecurityPlatform:
    url: str
    proc: subprocess.Popen[bytes]
    tmp: Path
    data_dir: Path
    env: dict[str, str]
    """The API process's environment (EMBER_*, AWS_*): the platform's settings."""
    moto_endpoint: str
    redis_url: str
    database_url: str
    admin_key: str = ADMIN_KEY
    admin_key_id: int = 0
    worker_key: str = ""
    worker_key_id: int = 0
    default_key: str = ""
    """A tenant key of the default tenant (the tenant the admin and worker keys belong to)."""
    default_key_id: int = 0
    tenants: dict[str, Tenant] = field(default_factory=dict)
    clients: dict[tuple[str | None, str | None], httpx.Client] = field(default_factory=dict)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def alice(self) -> Tenant:
        return self.tenants["alice"]

    @property
    def bob(self) -> Tenant:
        return self.tenants["bob"]

    def tenant(self, name: str) -> Tenant:
        return self.tenants[name]

    def client(self, key: str | None, act_as: str | None = None) -> httpx.Client:
        cached = self.clients.get((key, act_as))
        if cached is None:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            if act_as:
                headers["X-Ember-Tenant"] = act_as
            cached = httpx.Client(base_url=self.url, headers=headers, timeout=60)
            self.clients[(key, act_as)] = cached
        return cached

    @property
    def admin(self) -> httpx.Client:
        return self.client(self.admin_key)

    def s3(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.moto_endpoint, region_name="us-east-1")

    def cli_env(self, key: str | None) -> dict[str, str]:
        """The environment of an ``ember`` CLI command against this platform, as ``key``."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
        env = base | self.env | {"EMBER_URL": self.url}
        env.pop("EMBER_ADMIN_KEY", None)
        if key:
            env["EMBER_API_KEY"] = key
        return env

    def api_log(self, tail: int = 6000) -> str:
        path = self.tmp / "api.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def replica_logs(self, tail: int = 3000) -> str:
        logs = sorted((self.data_dir / "replicas").glob("*.log"))
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in logs)

    def start_worker(self, key: str | None = None) -> subprocess.Popen[bytes]:
        """An ``ember worker`` on this platform's Redis, calling the API with ``key``
        (default: the worker key); stopped at the end of the package."""
        n = len(self.workers) + 1
        log = self.tmp / f"worker-{n}.log"
        env = self.cli_env(None) | {
            "EMBER_JOBS_API_URL": self.url,
            "EMBER_JOBS_API_KEY": key or self.worker_key,
        }
        proc = subprocess.Popen([EMBER, "worker"], env=env, stdout=log.open("wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.workers.append(proc)
        services.wait_until(
            lambda: b"ready" in log.read_bytes() or proc.poll() is not None, 60, "ember worker"
        )
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        return proc

    def unrevoke(self, *key_ids: int) -> None:
        """Undo revocations straight in the registry (a failed test revoked a key the
        rest of the package needs; the API has no way back)."""
        import psycopg

        dsn = self.database_url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "UPDATE api_keys SET revoked_at = NULL WHERE id = ANY(%s)", (list(key_ids),)
            )

    def replica_pids(self) -> set[int]:
        pids: set[int] = set()
        for tenant in self.tenants.values():
            with contextlib.suppress(Exception):
                got = self.client(tenant.key).get(f"/v1/deployments/{tenant.deployment}/replicas")
                pids.update(r["pid"] for r in got.json()["replicas"] if r.get("pid"))
        return pids


def _expect(response: httpx.Response, status: int, what: str, platform: SecurityPlatform) -> Any:
    assert response.status_code == status, (
        f"{what}: {response.status_code} {response.text[:2000]}\n--- api.log\n{platform.api_log()}"
    )
    return response.json() if response.content else None


def _push(platform: SecurityPlatform, key: str, model: str, version: str) -> None:
    """``ember models push`` of a fresh MLP artifact, as the tenant would."""
    from ember.engine.examples.mlp import build_mlp_artifact

    path = build_mlp_artifact(platform.tmp / "artifacts" / model / version / "model.safetensors")
    pushed = subprocess.run(
        [EMBER, "models", "push", str(path), "--name", model, "--version", version,
         "--engine-config", json.dumps(MLP_CONFIG), "--input-schema", json.dumps(INPUT_SCHEMA)],
        env=platform.cli_env(key), cwd=platform.tmp, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert pushed.returncode == 0, (
        f"ember models push {model}:{version}: {pushed.stdout[-3000:]}{pushed.stderr[-3000:]}\n"
        f"--- api.log\n{platform.api_log()}"
    )


def _tenant(platform: SecurityPlatform, name: str) -> Tenant:
    admin = platform.admin
    _expect(admin.post("/v1/tenants", json={"name": name, "quotas": QUOTAS}), 201,
            f"create tenant {name}", platform)  # fmt: skip
    made = _expect(admin.post("/v1/keys", json={"name": name, "tenant": name}), 201,
                   f"{name}'s key", platform)  # fmt: skip
    key = made["key"]
    own = platform.client(key)
    spare = _expect(own.post("/v1/keys", json={"name": "spare"}), 201, f"{name}'s spare", platform)
    model = f"{name}-clf"
    _push(platform, key, model, "1")
    version = _expect(own.get(f"/v1/models/{model}/versions/1"), 200, f"{model}:1", platform)
    deployed = {"model": model, "version": "1", "min_hot": 1, "max_replicas": 1,
                "max_queue_delay_ms": 0}  # fmt: skip
    _expect(own.post("/v1/deployments", json=deployed), 201, f"deploy {model}", platform)
    batch_prefix = f"{STORE}/batch/{name}/"
    rows = "".join(json.dumps({"id": i, "features": X}) + "\n" for i in range(4))
    platform.s3().put_object(Bucket=BUCKET, Key=f"store/batch/{name}/in.jsonl", Body=rows.encode())
    input_uri, output_uri = f"{batch_prefix}in.jsonl", f"{batch_prefix}out/{{date}}"
    schedule = f"{name}-nightly"
    spec = {"name": schedule, "model": model, "input_uri": input_uri, "output_uri": output_uri,
            "cron": "0 3 * * *", "paused": True}  # fmt: skip
    _expect(own.post("/v1/batch/schedules", json=spec), 201, f"{name}'s schedule", platform)
    run = _expect(own.post("/v1/batch/runs", json={"schedule": schedule}), 202,
                  f"{name}'s run", platform)  # fmt: skip
    job = _expect(own.post("/v1/jobs", json={"model": model, "inputs": {"instances": [X]}}),
                  202, f"{name}'s job", platform)  # fmt: skip
    return Tenant(
        name=name,
        key=key,
        key_id=made["id"],
        key_prefix=made["prefix"],
        spare_key=spare["key"],
        spare_key_id=spare["id"],
        spare_key_prefix=spare["prefix"],
        model=model,
        version="1",
        deployment=model,
        artifact_uri=version["artifact_uri"],
        job_id=job["id"],
        schedule=schedule,
        run_id=run["id"],
        batch_prefix=batch_prefix,
        input_uri=input_uri,
        output_uri=output_uri,
    )


def _wait_ready(platform: SecurityPlatform, tenant: Tenant) -> None:
    own = platform.client(tenant.key)

    def ready() -> bool:
        got = own.get(f"/v1/deployments/{tenant.deployment}/replicas").json()["replicas"]
        if any(r["state"] == "failed" for r in got):
            pytest.fail(f"a replica of {tenant.deployment} failed:\n{platform.replica_logs()}")
        return any(r["state"] == "ready" for r in got)

    try:
        services.wait_until(ready, 240, f"a ready replica of {tenant.deployment}")
    except RuntimeError as exc:
        pytest.fail(f"{exc}\n{platform.replica_logs()}\n--- api.log\n{platform.api_log()}")


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="package")
def platform(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_url: str,
    redis_url: str,
    moto_endpoint: str,
) -> Iterator[SecurityPlatform]:
    tmp = tmp_path_factory.mktemp("security")
    data_dir = tmp / "data"
    data_dir.mkdir()
    import boto3

    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    database_url = services.fresh_postgres_database(postgres_url)
    port = services.free_port()
    env = {
        "EMBER_DATA_DIR": str(data_dir),
        "EMBER_HOST": "127.0.0.1",
        "EMBER_PORT": str(port),
        "EMBER_ADMIN_KEY": ADMIN_KEY,
        "EMBER_DATABASE_URL": database_url,
        "EMBER_REDIS_URL": redis_url,
        "EMBER_OBJECT_STORE_URL": STORE,
        "EMBER_S3_ENDPOINT_URL": moto_endpoint,
        "EMBER_STANDBY_REPLICAS": "0",
        "EMBER_STANDBY_RESERVE_MAX_BYTES": "0",
        "EMBER_WARM_SET_BYTES": "0",
        "EMBER_LOG_FORMAT": "json",
        "PYTHONUNBUFFERED": "1",
    }
    env |= {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    full = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | env
    with (tmp / "api.log").open("wb") as log:
        proc = subprocess.Popen([EMBER, "serve"], cwd=tmp, env=full, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    platform = SecurityPlatform(url, proc, tmp, data_dir, env, moto_endpoint, redis_url,
                                database_url)  # fmt: skip
    pids: set[int] = set()
    try:

        def up() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"ember serve exited {proc.returncode}:\n{platform.api_log()}")
            return httpx.get(f"{url}/readyz", timeout=2).status_code == 200

        services.wait_until(up, 90, "ember serve")
        admin = platform.admin
        keys = _expect(admin.get("/v1/keys", params={"limit": 500}), 200, "admin keys", platform)
        platform.admin_key_id = next(k["id"] for k in keys["items"] if k["scope"] == "admin")
        worker = _expect(admin.post("/v1/keys", json={"name": "worker", "scope": "worker"}), 201,
                         "the worker key", platform)  # fmt: skip
        platform.worker_key, platform.worker_key_id = worker["key"], worker["id"]
        default = _expect(admin.post("/v1/keys", json={"name": "default-tenant"}), 201,
                          "a default tenant key", platform)  # fmt: skip
        platform.default_key, platform.default_key_id = default["key"], default["id"]
        admin.patch("/v1/tenants/default", json={"quotas": QUOTAS})
        for name in ("alice", "bob"):
            platform.tenants[name] = _tenant(platform, name)
        for tenant in platform.tenants.values():
            _wait_ready(platform, tenant)
        pids = platform.replica_pids()
        yield platform
    finally:
        pids |= platform.replica_pids() if proc.poll() is None else set()
        for client in platform.clients.values():
            client.close()
        for worker_proc in platform.workers:
            _stop(worker_proc, 20)
        _stop(proc, 60)  # the API stops its replicas on the way out
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
