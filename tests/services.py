"""Real services for the test suite: PostgreSQL, Redis and an S3-compatible server.

Each is started on a free loopback port in a temporary directory and stopped at the end
of the session. Nothing here is mocked: the tests talk to the real servers over TCP.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not come up within {timeout_s}s")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def moto_server() -> Iterator[str]:
    port = free_port()
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/moto-api/").status_code < 500, 30, "moto server")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def redis_server() -> Iterator[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed: run `make test` (it installs it)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ember-redis-") as tmp:
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", tmp],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_until(lambda: _port_open(port), 15, "redis")
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


@contextmanager
def postgres_server() -> Iterator[str]:
    """A throw-away PostgreSQL cluster (initdb refuses root, so run as ``postgres``)."""
    initdb = shutil.which("initdb") or next(
        (str(p) for p in sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))), None
    )
    if initdb is None:
        raise RuntimeError("PostgreSQL is not installed: run `make test` (it installs it)")
    pg_ctl = str(Path(initdb).with_name("pg_ctl"))
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="ember-pg-"))
    data, sock = tmp / "data", tmp / "sock"
    sock.mkdir()
    as_pg: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(tmp, "postgres")
        shutil.chown(sock, "postgres")
        as_pg = ["runuser", "-u", "postgres", "--"]
    run = lambda *a: subprocess.run([*as_pg, *a], check=True, capture_output=True)  # noqa: E731
    run(initdb, "-D", str(data), "-A", "trust", "--no-sync", "-U", "postgres")
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    run(pg_ctl, "-D", str(data), "-o", opts, "-l", str(tmp / "log"), "-w", "start")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_pg, pg_ctl, "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)  # fmt: skip
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def serve_app(app: object) -> Iterator[str]:
    """Run an ASGI app under a real uvicorn server on loopback, in a thread."""
    import threading

    import uvicorn

    # The socket is bound here and handed to uvicorn: a port picked free and bound later
    # can be taken in between by another worker's process (EADDRINUSE, seen in CI).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,  # type: ignore[arg-type]
                            access_log=False, lifespan="on")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 30, "uvicorn")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def fresh_postgres_database(server_url: str) -> str:
    """A new empty database on the session's PostgreSQL server."""
    import uuid

    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    dsn = server_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return server_url.rsplit("/", 1)[0] + f"/{name}"


def migrated_registry(backend: str, tmp_path: Path, postgres_url: str, admin_key: str) -> Any:
    """A migrated, bootstrapped registry engine on ``backend`` (``sqlite`` in ``tmp_path``,
    or a fresh database on the session's PostgreSQL server at ``postgres_url``)."""
    from ember.registry.db import make_engine, migrate, session_scope
    from ember.registry.tenants import bootstrap

    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'r.db'}"
    else:
        url = fresh_postgres_database(postgres_url)
    engine = make_engine(url)
    migrate(engine)
    with session_scope(engine) as session:
        bootstrap(session, admin_key)
    return engine


def background_job(name: str, timeout_s: float = 1800) -> tuple[int, str] | None:
    """The result of a set-up job `scripts/test.sh` started in the background (its exit
    status and log), waiting for it to finish; None when the suite runs without one."""
    jobs = os.environ.get("TEST_JOBS_DIR")
    if not jobs or not (Path(jobs) / f"{name}.log").exists():
        return None
    rc_file, log_file = Path(jobs) / f"{name}.rc", Path(jobs) / f"{name}.log"
    deadline = time.monotonic() + timeout_s
    while not rc_file.exists() or not rc_file.read_text().strip():
        if time.monotonic() > deadline:
            raise RuntimeError(f"background job {name} still running after {timeout_s}s")
        time.sleep(1)
    return int(rc_file.read_text().strip()), log_file.read_text()


def process_environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with (``/proc/<pid>/environ``, as the
    API's user may read a replica's)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (e.split(b"=", 1) for e in raw.split(b"\0") if b"=" in e)
    return {k.decode(): v.decode() for k, v in pairs}


def replica_secret_headers(pid: int | None) -> dict[str, str]:
    """The header that authenticates a call to a live replica's API: its secret, read from
    its environment (tests and benches that call a replica directly)."""
    from ember.domain.spec import REPLICA_SECRET_ENV, replica_auth

    if pid is None:
        return {}
    return replica_auth(process_environ(pid).get(REPLICA_SECRET_ENV, ""))
