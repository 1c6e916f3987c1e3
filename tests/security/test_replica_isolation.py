"""Local replicas: an authenticated API, an allowlisted environment, an unprivileged user,
and files a replica's uid cannot open (issue 20 §2 local, §3).

Against a live API (pools on) with real ``ember engine`` replicas (tests/gateway's
``live_api``), on a data directory under a base that other users may traverse (as a
deployment's would be), so that file modes, not pytest's 0700 tmp directory, are what
keeps a replica's uid out.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import ember
from ember.config import Settings
from ember.domain.spec import REPLICA_SECRET_ENV, REPLICA_SECRET_HEADER
from ember.engine.privileges import blocked_for_others, drop_to, tenant_home
from ember.loader.cache import tenant_cache_dir
from ember.pools.backends.base import ReplicaHandle
from ember.pools.backends.local import replica_environ
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.gateway.conftest import Live, deploy, live_api, replica_auth
from tests.services import process_environ

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


def test_the_replica_api_needs_its_secret_and_reveals_nothing(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    live.register("mlp", "1")
    deploy(live, "mlp")
    replica = _replica(live, "mlp")
    url, pid = replica["url"], replica["pid"]
    assert url.startswith("http://127.0.0.1:")  # bound to loopback
    secret = process_environ(pid).get(REPLICA_SECRET_ENV, "")
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
    env = process_environ(_replica(live, "mlp")["pid"])
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


def test_a_batch_lane_sends_each_replica_its_secret() -> None:
    """The worker's direct lane: each target's client carries its replica's secret, and a
    replica named again with a new secret (same id and address) gets a new client."""
    from ember.batch.client import Lane
    from ember.work.client import GatewayClient

    lane = Lane(GatewayClient("http://127.0.0.1:1", {}), "acme", "m", "1")
    try:
        lane._adopt([{"id": "a", "url": "http://127.0.0.1:4", "secret": "s1", "window": 8}])
        first = lane.targets[0]
        assert first.client.headers == {REPLICA_SECRET_HEADER: "s1"}
        lane._adopt([{"id": "a", "url": "http://127.0.0.1:4", "secret": "s1", "window": 8}])
        assert lane.targets == [first]  # the same target: nothing changed
        lane._adopt([{"id": "a", "url": "http://127.0.0.1:4", "secret": "s2", "window": 8}])
        (second,) = lane.targets
        assert second is not first and second.client is not first.client
        assert second.client.headers == {REPLICA_SECRET_HEADER: "s2"}
        lane._adopt([{"id": "b", "url": "http://127.0.0.1:5", "window": 8}])
        assert lane.targets[0].client.headers == {}  # a replica without a secret
    finally:
        lane.close()


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


# --- the API as root, replicas as the tenant's uid (live) --------------------------------

TENANT = "isolated"


def _status(pid: int, task: int | None = None) -> dict[str, list[str]]:
    """``/proc/<pid>/status`` (of one thread, ``task``): each line's fields by name."""
    where = Path(f"/proc/{pid}") / (f"task/{task}" if task is not None else "")
    lines = (line.split(":", 1) for line in (where / "status").read_text().splitlines())
    return {name: value.split() for name, value in lines}


def _uids(pid: int) -> list[int]:
    """The process's real, effective, saved and filesystem uids (``/proc/<pid>/status``)."""
    return [int(field) for field in _status(pid)["Uid"]]


def _memlock(pid: int) -> str:
    """The process's soft ``RLIMIT_MEMLOCK`` (``/proc/<pid>/limits``)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max locked memory"):
            return line.split()[3]
    raise AssertionError("no Max locked memory line")


def _replica_python() -> tuple[Path, Path | None]:
    """An interpreter another user can start, for the API whose replicas run as the
    tenants' uids, and the temporary directory made for it (None: this one will do).

    Where this interpreter is under a directory others cannot traverse (pyenv's under a
    0700 ``/root``, as on the CI machine), an overlay virtualenv is made on a system
    Python of the same version (``/usr/bin/python3.X``, world-readable) in a 0755
    temporary directory: a ``.pth`` file adds this virtualenv's site-packages (Ember's
    editable install and its dependencies; same ABI), and its ``bin/ember`` is this one's
    console script with the overlay's interpreter. Skips, saying why, where neither works."""
    here = [Path(sys.executable).resolve(), Path(sys.base_prefix).resolve()]
    if all(blocked_for_others(p) is None for p in here):
        return Path(sys.executable), None
    site_packages = Path(sysconfig.get_paths()["purelib"])
    needed = [site_packages, Path(ember.__file__).resolve().parent]
    for path in needed:
        if (found := blocked_for_others(path)) is not None:
            pytest.skip(f"{found} (on the way to {path}) is not traversable by other users")
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = next((Path(d) / version for d in ("/usr/bin", "/usr/local/bin")
                   if (Path(d) / version).is_file()), None)  # fmt: skip
    if system is None or blocked_for_others(system.parent) is not None:
        pytest.skip(f"{sys.executable} is not traversable by other users and there is no "
                    f"system {version} to make an overlay virtualenv with")  # fmt: skip
    base = Path(tempfile.mkdtemp(prefix="ember-overlay-"))
    base.chmod(0o755)
    venv = base / "venv"
    made = subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)],
                          capture_output=True, text=True)  # fmt: skip
    if made.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"{system} -m venv failed: {made.stderr.strip()[-500:]}")
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    # redis-py imports async-timeout before Python 3.11.3 (Debian's is 3.11.2), which the
    # virtualenv (3.11.7) does not have: asyncio's own timeout is what it stands for
    Path(purelib, "async_timeout.py").write_text("from asyncio import timeout\n")
    Path(purelib, "ember-overlay.pth").write_text(
        f"import site; site.addsitedir({str(site_packages)!r})\n"
    )
    script = Path(sys.executable).with_name("ember").read_text().splitlines()
    assert script[0].startswith("#!"), script[0]
    ember_script = venv / "bin" / "ember"
    ember_script.write_text("\n".join([f"#!{python}", *script[1:]]) + "\n")
    ember_script.chmod(0o755)
    # what a replica's uid does first: start the interpreter and import the engine
    uid = Settings().replica_uid_base
    tried = subprocess.run(
        [str(python), "-c", "import ember.cli, ember.engine.server, torch"],
        capture_output=True, text=True, cwd="/", env={"PATH": os.environ.get("PATH", ""),
        "PYTHONDONTWRITEBYTECODE": "1"}, preexec_fn=lambda: drop_to(uid, uid),
    )  # fmt: skip
    if tried.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"the overlay virtualenv does not start as uid {uid}: "
                    f"{tried.stderr.strip()[-500:]}")  # fmt: skip
    return python, base


@pytest.fixture
def root_api(open_data_dir: Path, secrets_env: None) -> Iterator[tuple[Live, Path, int]]:
    """``ember serve`` as root, its interpreter one a replica's uid can start (an overlay
    virtualenv where needed: ``_replica_python``), one standby process, and a client of
    tenant ``TENANT``'s (a tenant other than the default); yields it and its log."""
    if os.geteuid() != 0:
        pytest.skip("the API runs as root here only")
    python, overlay = _replica_python()
    port = services.free_port()
    env = {k: v for k, v in os.environ.items() if k != "EMBER_DATA_DIR"} | {
        "EMBER_DATA_DIR": str(open_data_dir),
        "EMBER_HOST": "127.0.0.1",
        "EMBER_PORT": str(port),
        "EMBER_STANDBY_REPLICAS": "1",
        "EMBER_STANDBY_RESERVE_MAX_BYTES": "0",
        "EMBER_REPLICA_USER": "auto",
        "EMBER_LOG_FORMAT": "json",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",  # leave the checkout's bytecode as it is
    }
    api_log = open_data_dir.parent / "api.log"
    with api_log.open("wb") as out:
        proc = subprocess.Popen([str(python.with_name("ember")), "serve"], env=env,
                                cwd=open_data_dir.parent, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=60)  # fmt: skip
    client: httpx.Client | None = None
    try:

        def up() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"ember serve exited {proc.returncode}:\n{api_log.read_text()}")
            return admin.get("/readyz", timeout=2).status_code == 200

        services.wait_until(up, 90, "ember serve")
        assert admin.post("/v1/tenants", json={"name": TENANT}).status_code == 201
        made = admin.post("/v1/keys", json={"name": TENANT, "tenant": TENANT})
        assert made.status_code == 201, made.text
        auth = {"Authorization": f"Bearer {made.json()['key']}"}
        client = httpx.Client(base_url=url, timeout=60, headers=auth)
        store = open_data_dir / "objects" / "artifacts" / TENANT
        yield Live(url, client, store), api_log, proc.pid
    finally:
        if client is not None:
            client.close()
        pids = {int(p) for p in _children(proc.pid)}
        proc.terminate()
        try:
            proc.wait(60)  # the API stops its replicas on the way out
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        admin.close()
        if overlay is not None:
            shutil.rmtree(overlay, ignore_errors=True)


def _children(pid: int) -> list[str]:
    """The processes ``pid`` started (its replicas: each in a session of its own)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            for line in status.read_text().splitlines():
                if line.startswith("PPid:") and int(line.split()[1]) == pid:
                    found.append(status.parent.name)
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="the API runs as root here only")
def test_replicas_run_as_the_tenants_uid_where_the_api_is_root(
    root_api: tuple[Live, Path, int], open_data_dir: Path
) -> None:
    """A replica started for a version and a standby process assigned one both run as the
    tenant's uid (real, effective, saved; every thread, no groups, no capabilities), not
    root, and serve; the registry is not theirs."""
    live, api_log, api_pid = root_api
    admin = httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})

    def logs() -> str:
        replicas = sorted((open_data_dir / "replicas").glob("*.log"))
        tails = [f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in replicas]
        return "\n".join([f"--- api.log\n{api_log.read_text(errors='replace')[-4000:]}", *tails])

    with admin:
        standby = 'deployment="(standby)",model="-",state="standby"'
        live.wait(lambda: standby in admin.get("/metrics").text, "a ready standby process")
        live.register("mlp", "1")
        # two hot replicas: one takes the ready standby process, the other starts cold
        try:
            deploy(live, "mlp", min_hot=2, max_replicas=2)
        except RuntimeError as exc:
            pytest.fail(f"{exc}\n{live.replicas('mlp')}\n{logs()}")
    events = live.events("mlp")
    tenant_id = events[0]["tenant_id"]
    assert tenant_id >= 2 and {e["tenant_id"] for e in events} == {tenant_id}  # not the default
    uid = Settings().replica_uid_base + tenant_id
    assigned = {e["replica_id"] for e in events if e["event"] == "assigned"}
    cold = {e["replica_id"] for e in events if e["event"] == "starting"}
    assert len(assigned) == 1 and len(cold) == 1, events
    ready = {r["replica_id"]: r for r in live.ready("mlp")}
    assert set(ready) == assigned | cold, (ready, events)
    for replica in ready.values():
        pid = replica["pid"]
        assert _uids(pid) == [uid] * 4, (replica, logs())
        for task in Path(f"/proc/{pid}/task").iterdir():  # every thread: none kept root
            status = _status(pid, int(task.name))
            assert status["Uid"] == status["Gid"] == [str(uid)] * 4, (task, status)
            assert status.get("Groups", []) == [] and int(status["CapEff"][0], 16) == 0
        # the loader's mlock limit: lifted where the host lets root lift it, never lowered
        assert _memlock(pid) in ("unlimited", _memlock(api_pid)), _memlock(pid)
        answer = httpx.post(f"{replica['url']}/infer", headers=replica_auth(replica),
                            json={"instances": [[0.5] * 256]}, timeout=60)  # fmt: skip
        assert answer.status_code == 200, answer.text
    for _ in range(4):  # the gateway reaches both
        assert live.predict("mlp").status_code == 200
    # the registry is root's alone: a replica's uid cannot open it
    registry = (open_data_dir / "registry.db").stat()
    assert registry.st_uid == 0 and registry.st_mode & 0o077 == 0
    # the tenant's cache and home are its uid's; its entry was filled by the replicas
    settings = Settings(data_dir=open_data_dir)
    cache = tenant_cache_dir(settings.weight_cache_dir, tenant_id)
    assert cache.stat().st_uid == uid and list(cache.glob("v1/*/*/*/weights.safetensors"))
    assert tenant_home(open_data_dir, tenant_id).stat().st_uid == uid
