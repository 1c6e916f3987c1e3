"""Local replicas: an authenticated API, an allowlisted environment, an unprivileged user,
and files a replica's uid cannot open (issue 20 §2 local, §3).

Against a live API (pools on) with real ``ember engine`` replicas (tests/gateway's
``live_api``), on a data directory under a base that other users may traverse (as a
deployment's would be), so that file modes, not pytest's 0700 tmp directory, are what
keeps a replica's uid out.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.config import Settings
from ember.engine.privileges import drop_to
from ember.engine.spec import REPLICA_SECRET_ENV, REPLICA_SECRET_HEADER
from ember.pools.backends.base import ReplicaHandle
from ember.pools.backends.local import LocalProcessBackend, replica_environ
from tests.api.conftest import ADMIN_KEY
from tests.gateway.conftest import Live, deploy, live_api

REDIS_URL = "redis://:hunter2-redis@127.0.0.1:6390/0"  # never reached: the API tolerates it
JOBS_KEY = "ek_jobs-key-that-must-stay-in-the-api"


@pytest.fixture
def open_data_dir() -> Iterator[Path]:
    """A data directory whose parents other users may traverse (0711), not pytest's."""
    base = Path(tempfile.mkdtemp(prefix="ember-isolation-"))
    base.chmod(0o711)
    data = base / "data"
    data.mkdir()
    try:
        yield data
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def secrets_env(open_data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API's environment holds the platform's secrets, as ``make up``'s does."""
    monkeypatch.setenv("EMBER_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.setenv("EMBER_DATABASE_URL", f"sqlite:///{open_data_dir / 'registry.db'}")
    monkeypatch.setenv("EMBER_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("EMBER_JOBS_API_KEY", JOBS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-not-for-a-file-store-replica")
    monkeypatch.setenv("SOME_OTHER_TOKEN", "unrelated-secret")


@pytest.fixture
def live(open_data_dir: Path, secrets_env: None) -> Iterator[Live]:
    with live_api(open_data_dir, standby_replicas=0) as api:
        yield api


def _replica(live: Live, deployment: str) -> dict[str, Any]:
    ready = live.ready(deployment)
    assert ready, live.replicas(deployment)
    return ready[0]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (e.split(b"=", 1) for e in raw.split(b"\0") if b"=" in e)
    return {k.decode(): v.decode() for k, v in pairs}


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


def test_the_replica_api_needs_its_secret_and_reveals_nothing(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    live.register("mlp", "1")
    deploy(live, "mlp")
    replica = _replica(live, "mlp")
    url, pid = replica["url"], replica["pid"]
    assert url.startswith("http://127.0.0.1:")  # bound to loopback
    secret = _environ(pid).get(REPLICA_SECRET_ENV, "")
    assert len(secret) >= 40  # secrets.token_urlsafe(32)
    spec = live.client.get("/v1/models/mlp/versions/1").json()
    calls = [
        ("POST", "/infer", {"json": {"instances": [[0.5] * 256]}}),
        ("POST", "/tier", {"json": {"tier": "warm"}}),
        ("POST", "/assign", {"json": {"model": "x", "version": "1", "artifact_uri": "file:///x",
                                      "sha256": spec["sha256"], "engine": "torch"}}),
        ("GET", "/info", {}),
        ("GET", "/metrics", {}),
        ("GET", "/docs", {}),
    ]  # fmt: skip
    for wrong in ({}, {REPLICA_SECRET_HEADER: "nope"}, {REPLICA_SECRET_HEADER: secret[:-1]}):
        for method, path, extra in calls:
            answer = httpx.request(method, url + path, headers=wrong, timeout=30, **extra)
            assert answer.status_code == 401, (path, answer.text)
            body = answer.json()
            assert body["type"].endswith("/unauthenticated") and secret not in answer.text
            assert "mlp" not in answer.text and "x-ember-model" not in answer.headers
    # the probes stay open (the controller's idle probe, a kubelet)
    assert httpx.get(url + "/healthz", timeout=30).status_code == 200
    assert httpx.get(url + "/readyz", timeout=30).status_code == 200
    # with the secret, the replica answers (it is the secret that is checked)
    good = {REPLICA_SECRET_HEADER: secret}
    info = httpx.get(url + "/info", headers=good, timeout=30)
    assert info.status_code == 200 and info.json()["state"] == "ready"
    # the gateway (and the controller behind it) still serve
    assert live.predict("mlp").status_code == 200
    # the secret is in no argv, no log line
    assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    logs = live.store.parent / "replicas"
    for log in logs.glob("*.log"):
        assert secret not in log.read_text(errors="replace"), log
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err
    assert secret not in repr(ReplicaHandle("r", url, pid, secret=secret))


def test_a_replica_inherits_no_platform_secret(live: Live) -> None:
    live.register("mlp", "1")
    deploy(live, "mlp")
    env = _environ(_replica(live, "mlp")["pid"])
    for name in ("EMBER_ADMIN_KEY", "EMBER_DATABASE_URL", "EMBER_REDIS_URL",
                 "EMBER_JOBS_API_KEY", "AWS_SECRET_ACCESS_KEY", "SOME_OTHER_TOKEN"):  # fmt: skip
        assert name not in env, name
    values = "\n".join(env.values())
    for secret in (ADMIN_KEY, "hunter2-redis", JOBS_KEY, "registry.db", "unrelated-secret"):
        assert secret not in values
    assert env["EMBER_DATA_DIR"] == str(live.store.parent)
    assert env["HOME"] != os.environ.get("HOME")  # a private one, under the data directory
    assert Path(env["HOME"]).is_relative_to(live.store.parent / "replicas")


def test_the_allowlist_never_passes_a_denied_name() -> None:
    environ = {"PATH": "/bin", "EMBER_ADMIN_KEY": "k", "EMBER_DATABASE_URL": "postgres://",
               "EMBER_LOG_LEVEL": "INFO", "AWS_ACCESS_KEY_ID": "a", "EMBER_CACHE_DIR": "/c",
               "LC_ALL": "C", "MY_VAR": "x"}  # fmt: skip
    plain = replica_environ(environ, s3=False, passthrough=["MY_VAR", "EMBER_ADMIN_KEY"])
    assert plain == {"PATH": "/bin", "EMBER_LOG_LEVEL": "INFO", "EMBER_CACHE_DIR": "/c",
                     "LC_ALL": "C", "MY_VAR": "x"}  # fmt: skip
    assert replica_environ(environ, s3=True)["AWS_ACCESS_KEY_ID"] == "a"


def _as_uid(uid: int, attempt: list[Path]) -> list[str]:
    """In a forked child dropped to ``uid``: what of ``attempt`` it could open."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        opened = []
        try:
            drop_to(uid, uid)
            for path in attempt:
                try:
                    if path.is_dir():
                        os.listdir(path)
                    else:
                        path.open("rb").close()
                    opened.append(str(path))
                except OSError:
                    pass
            os.write(write, "\n".join(opened).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        out = pipe.read()
    os.waitpid(pid, 0)
    return [line for line in out.splitlines() if line]


@pytest.mark.skipif(os.geteuid() != 0, reason="changing uid needs root")
def test_a_replica_uid_cannot_open_the_registry_or_another_tenants_cache(live: Live) -> None:
    live.register("mlp", "1")
    deploy(live, "mlp")
    data = live.store.parent
    settings = Settings(data_dir=data)
    tenant_cache = settings.weight_cache_dir / "t1"  # the default tenant's (id 1)
    entries = list(tenant_cache.glob("v1/*/*/*/weights.safetensors"))
    assert entries, list(settings.weight_cache_dir.rglob("*"))
    spec_files = list((data / "replicas").glob("*.spec.json"))
    another_tenant = settings.replica_uid_base + 2
    registry = data / "registry.db"
    targets = [registry, tenant_cache, entries[0], *spec_files]
    assert _as_uid(another_tenant, targets) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="the API runs as root here only")
def test_replicas_run_as_the_tenants_uid_where_the_api_is_root(live: Live) -> None:
    backend = LocalProcessBackend(Settings(data_dir=live.store.parent))
    blocked = backend._blocked()
    if blocked is not None:  # e.g. an interpreter under /root: replicas run as root, warned
        pytest.skip(f"{blocked} is not traversable by other users on this machine")
    live.register("mlp", "1")
    deploy(live, "mlp")
    pid = _replica(live, "mlp")["pid"]
    assert _uid(pid) == Settings().replica_uid_base + 1
