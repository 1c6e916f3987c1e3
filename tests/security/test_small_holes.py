"""The small holes (issue 20 §7): ``/metrics``, webhooks (SSRF, slow receivers), the
local Redis that ``ember up`` starts.

Each test is an attack that worked before: ``/metrics`` read without a key (every
tenant's deployments), webhooks to private IPv4 addresses through IPv6 transition
forms, a receiver that drips its answer and holds a worker, an endless answer read
whole, and a local Redis without a password, shared by every data directory and left
running by a Ctrl-C.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session, select

from ember.api.app import create_app, prepare
from ember.config import Settings
from ember.errors import InvalidInput
from ember.jobs import records, webhooks
from ember.jobs.queue import Publisher
from ember.local import LocalRedis, answers_with, ensure_redis
from ember.registry.tables import Job
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.security.conftest import SecurityPlatform, X
from tests.test_up import EMBER

# --- /metrics -----------------------------------------------------------------------


def _series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_metrics_need_a_key_and_a_tenant_sees_only_its_own(platform: SecurityPlatform) -> None:
    for tenant in (platform.alice, platform.bob):
        own = platform.client(tenant.key)
        answer = own.post(f"/v1/models/{tenant.model}:predict", json={"instances": [X]})
        assert answer.status_code == 200, answer.text

    anonymous = platform.client(None).get("/metrics")
    assert anonymous.status_code == 401, anonymous.text[:300]
    assert "alice" not in anonymous.text and "bob" not in anonymous.text

    everything = platform.admin.get("/metrics")
    assert everything.status_code == 200
    requests = _series(everything.text, "ember_gateway_requests_total")
    for tenant in (platform.alice, platform.bob):  # every series names its tenant
        assert any(
            f'tenant="{tenant.name}"' in line and f'deployment="{tenant.deployment}"' in line
            for line in requests
        ), requests
    assert all('tenant="' in line for line in requests), requests
    replicas = _series(everything.text, "ember_replicas")
    assert any('tenant="alice"' in line for line in replicas), replicas

    bobs = platform.client(platform.bob.key).get("/metrics")
    assert bobs.status_code == 200
    assert platform.bob.deployment in bobs.text
    assert "alice" not in bobs.text, [line for line in bobs.text.splitlines() if "alice" in line]
    samples = [line for line in bobs.text.splitlines() if line and not line.startswith("#")]
    assert samples and all('tenant="bob"' in line for line in samples), samples


def test_metrics_on_their_own_port_are_on_loopback_only(data_dir: Path) -> None:
    port = services.free_port()
    settings = Settings(
        data_dir=data_dir,
        admin_key=ADMIN_KEY,  # type: ignore[arg-type]
        metrics_port=port,
        standby_replicas=0,
    )
    with services.serve_app(create_app(settings)) as url:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        on_api = httpx.get(f"{url}/metrics", headers=admin)
        assert on_api.status_code == 404  # not on the API port, even for an admin
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics")
        assert scraped.status_code == 200
        assert "# TYPE ember_replicas gauge" in scraped.text
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 404
        with pytest.raises(httpx.ConnectError):  # bound to 127.0.0.1, not every address
            httpx.get(f"http://127.0.0.2:{port}/metrics")


# --- webhooks: the address check ------------------------------------------------------

BLOCKED = {
    "IPv4 private": "10.1.2.3",
    "IPv4 shared (CGNAT)": "100.64.0.1",
    "IPv4 link-local": "169.254.169.254",
    "IPv4 loopback": "127.0.0.1",
    "IPv4 unspecified": "0.0.0.0",
    "IPv4 multicast": "224.0.0.1",
    "IPv4 reserved": "240.0.0.1",
    "IPv6 loopback": "::1",
    "IPv6 unspecified": "::",
    "IPv4-mapped private": "::ffff:10.0.0.1",
    "IPv4-mapped loopback": "::ffff:127.0.0.1",
    "IPv4-compatible": "::127.0.0.1",
    "IPv4-compatible public": "::93.184.215.14",
    "IPv4-translated (SIIT)": "::ffff:0:10.0.0.1",
    "6to4 of a private IPv4": "2002:c0a8:0101::1",
    "6to4 of loopback": "2002:7f00:1::",
    "6to4 of the metadata address": "2002:a9fe:a9fe::1",
    "NAT64 of a private IPv4": "64:ff9b::10.0.0.1",
    "NAT64 of the metadata address": "64:ff9b::169.254.169.254",
    "local-use NAT64": "64:ff9b:1::93.184.215.14",
    "Teredo": "2001:0:4136:e378:8000:63bf:3fff:fdd2",
    "Teredo of a private client": "2001:0:4136:e378:8000:63bf:f5fe:fefe",
    "ISATAP of a private IPv4": "2a00:1450:4001::5efe:10.0.0.1",
    "site-local": "fec0::1",
    "unique local": "fd12:3456:789a::1",
    "link-local": "fe80::1",
    "multicast": "ff02::1",
    "documentation": "2001:db8::1",
    "documentation (RFC 9637)": "3fff::1",
    "discard-only": "100::1",
    "SRv6 SID": "5f00::1",
    # IETF protocol assignments that newer Pythons' ipaddress counts global
    "IETF assignment (AMT)": "2001:3::1",
    "IETF assignment (ORCHIDv2)": "2001:20::1",
}
PUBLIC = {
    "IPv4": "93.184.215.14",
    "IPv6": "2606:4700:4700::1111",
    "IPv4-mapped public": "::ffff:93.184.215.14",
    "6to4 of a public IPv4": "2002:5db8:d70e::1",
    "NAT64 of a public IPv4": "64:ff9b::93.184.215.14",
}


@pytest.mark.parametrize("family", sorted(BLOCKED))
def test_webhooks_refuse_every_address_that_reaches_a_private_one(family: str) -> None:
    address = BLOCKED[family]
    assert webhooks.blocked(ipaddress.ip_address(address)), family
    host = f"[{address}]" if ":" in address else address
    with pytest.raises(InvalidInput, match="non-public"):
        webhooks.check_url(f"http://{host}:8080/hook", allow_private=False, must_resolve=True)


@pytest.mark.parametrize("family", sorted(PUBLIC))
def test_webhooks_take_public_addresses(family: str) -> None:
    assert not webhooks.blocked(ipaddress.ip_address(PUBLIC[family])), family


# --- webhooks: the delivery -----------------------------------------------------------


HUGE = 256 * 1024 * 1024


class Receiver:
    """A real TCP receiver on 127.0.0.1 that answers every connection with ``answer``."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.requests: list[bytes] = []
        self.sent = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                self.requests.append(conn.recv(65536))
                if self.answer == "drip":  # a byte per half second, for a minute
                    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100:
                        if self.stop.is_set():
                            return
                        conn.sendall(bytes([byte]))
                        self.sent += 1
                        time.sleep(0.5)
                elif self.answer == "huge":  # 200, then 256 MiB as fast as it is taken
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % HUGE)
                    chunk = b"x" * 65536
                    while self.sent < HUGE and not self.stop.is_set():
                        conn.sendall(chunk)
                        self.sent += len(chunk)
                else:
                    conn.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@contextmanager
def receiver(answer: str) -> Iterator[Receiver]:
    r = Receiver(answer)
    try:
        yield r
    finally:
        r.close()


def _job_with_webhook(settings: Settings, url: str) -> str:
    engine, _ = prepare(settings)
    with records.transaction(engine) as session:
        row = Job(
            uid=records.new_uid(),
            tenant_id=1,
            model="m",
            deployment="m",
            status="succeeded",
            request_sha256="0" * 64,
            webhook_url=url,
            webhook_status="pending",
            webhook_next_at=records.utcnow(),
        )
        session.add(row)
    return row.uid


def _deliver(settings: Settings, uid: str) -> tuple[str, Job, float]:
    engine, _ = prepare(settings)
    publisher = Publisher(settings)
    started = time.monotonic()
    try:
        outcome = webhooks.deliver(engine, settings, publisher, uid, lambda s, j: {"id": j.uid})
    finally:
        took = time.monotonic() - started
        publisher.close()
    with Session(engine) as session:
        job = session.exec(select(Job).where(Job.uid == uid)).one()
    return outcome, job, took


def _webhook_settings(data_dir: Path, redis_url: str) -> Settings:
    return Settings(
        data_dir=data_dir,
        redis_url=redis_url,
        jobs_webhook_allow_private=True,  # the receivers are on 127.0.0.1
        jobs_webhook_timeout_s=1.0,
        jobs_webhook_max_attempts=3,
    )


def test_a_slow_drip_receiver_cannot_hold_a_worker(data_dir: Path, redis_url: str) -> None:
    settings = _webhook_settings(data_dir, redis_url)
    with receiver("drip") as hook:
        uid = _job_with_webhook(settings, f"http://127.0.0.1:{hook.port}/hook")
        outcome, job, took = _deliver(settings, uid)
    assert hook.requests, "the receiver was reached"
    assert outcome == "retry" and job.webhook_status == "pending", (outcome, job)
    assert job.webhook_error and "Timeout" in job.webhook_error, job.webhook_error
    # Not a performance bound: the receiver would drip for a minute; this says the
    # delivery gave up by its (1 s) deadline instead of per read.
    assert took < 3 * settings.jobs_webhook_timeout_s, took
    assert hook.sent < 10, hook.sent


def test_a_huge_answer_is_read_only_up_to_a_cap(data_dir: Path, redis_url: str) -> None:
    settings = _webhook_settings(data_dir, redis_url)
    with receiver("huge") as hook:
        uid = _job_with_webhook(settings, f"http://127.0.0.1:{hook.port}/hook")
        outcome, job, _ = _deliver(settings, uid)
        time.sleep(0.5)  # what the receiver still gets rid of once the sender left
        sent = hook.sent
    assert outcome == "delivered" and job.webhook_status == "delivered", (outcome, job)
    # The delivery read a few KiB and dropped the connection: the receiver could hand
    # the kernel no more than the socket buffers hold, far from the whole answer.
    assert sent < HUGE // 4, sent


def test_a_delivery_connects_to_the_checked_address_with_the_urls_host() -> None:
    with receiver("ok") as hook:
        client = webhooks.pinned_client(ipaddress.ip_address("127.0.0.1"), 5.0)
        with client:  # the host does not resolve: the connection goes where it was told
            answer = client.post(f"http://hooks.example.invalid:{hook.port}/x", content=b"{}")
    assert answer.status_code == 204
    assert f"host: hooks.example.invalid:{hook.port}" in hook.requests[0].decode().lower()


def test_a_delivery_to_a_private_address_is_refused_before_any_connection(
    data_dir: Path, redis_url: str
) -> None:
    settings = _webhook_settings(data_dir, redis_url).model_copy(
        update={"jobs_webhook_allow_private": False}
    )
    with receiver("ok") as hook:
        uid = _job_with_webhook(settings, f"http://[::ffff:127.0.0.1]:{hook.port}/hook")
        outcome, job, _ = _deliver(settings, uid)
    assert outcome == "refused" and "non-public" in (job.webhook_error or "")
    assert not hook.requests


# --- the local Redis ------------------------------------------------------------------


def _ping(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(256)


def _port(redis: LocalRedis) -> int:
    return int(redis.url.rsplit(":", 1)[1].split("/")[0])


def _cmdlines() -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:
                continue
    return out


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def test_each_data_directory_gets_its_own_redis_with_a_password(tmp_path: Path) -> None:
    port = services.free_port()  # both ask for the same port
    one = Settings(data_dir=tmp_path / "one", local_redis_port=port)
    two = Settings(data_dir=tmp_path / "two", local_redis_port=port)
    first = ensure_redis(one)
    try:
        second = ensure_redis(two)
        try:
            assert first.proc is not None and second.proc is not None
            assert _port(first) != _port(second), (first.shown, second.shown)
            for settings, redis in ((one, first), (two, second)):
                workdir = settings.data_dir / "redis"
                password = (workdir / "password").read_text().strip()
                assert len(password) >= 32 and f":{password}@" in redis.url
                assert password not in redis.shown
                assert (workdir / "port").read_text().strip() == str(_port(redis))
                assert os.stat(workdir).st_mode & 0o777 == 0o700
                for name in ("password", "redis.conf"):
                    assert os.stat(workdir / name).st_mode & 0o777 == 0o600, name
                assert _ping(_port(redis)).startswith(b"-NOAUTH"), "a client without the password"
                everywhere = b"\n".join(_cmdlines().values())
                assert password.encode() not in everywhere  # no process's argv carries it
            mine = (tmp_path / "one" / "redis" / "password").read_text().strip()
            other = (tmp_path / "two" / "redis" / "password").read_text().strip()
            assert not answers_with(_port(first), other)  # one's password is not the other's
            # A second start of a data directory uses its running Redis, not another.
            again = ensure_redis(one)
            assert again.url == first.url and again.proc is None
        finally:
            second.stop()
    finally:
        first.stop()
    assert first.proc is None and second.proc is None
    assert not answers_with(_port(first), mine) and not answers_with(_port(second), other)


def test_ctrl_c_stops_ember_ups_redis_worker_and_beat(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {
        "EMBER_DATA_DIR": str(data),
        "EMBER_PORT": str(services.free_port()),
        "EMBER_LOCAL_REDIS_PORT": str(services.free_port()),
        "EMBER_POOLS_ENABLED": "false",
    }
    full = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | env
    proc = subprocess.Popen(
        [EMBER, "up"], env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        url = f"http://127.0.0.1:{env['EMBER_PORT']}"
        services.wait_until(
            lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200, 90, "ember up"
        )
        marker = f"--parent-pid\0{proc.pid}\0".encode()

        def children() -> list[int]:
            return [pid for pid, cmd in _cmdlines().items() if marker in cmd and _alive(pid)]

        services.wait_until(lambda: len(children()) == 2, 60, "the worker and the beat")
        workdir = data / "redis"
        redis_pid = int((workdir / "redis.pid").read_text())
        port = int((workdir / "port").read_text())
        password = (workdir / "password").read_text().strip()
        assert _alive(redis_pid)
        assert _ping(port).startswith(b"-NOAUTH")
        assert answers_with(port, password)
        assert password.encode() not in b"\n".join(_cmdlines().values())
        time.sleep(3)  # the worker and the beat connected to Redis with the password...
        running = children()
        assert len(running) == 2, "a worker or the beat died (did it reach Redis?)"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert password not in out, "ember up printed the Redis password"
    assert re.search(rf"redis:\s+127\.0\.0\.1:{port}/0", out), out[-2000:]
    assert not _alive(redis_pid), "the local redis outlived ember up"
    assert not answers_with(port, password)
    left = [pid for pid in running if _alive(pid)]
    assert not left, f"processes of ember up still running: {left}"


def test_replicas_do_not_outlive_an_api_killed_outright(tmp_path: Path) -> None:
    """An API killed with SIGKILL (or by the OOM killer) ran no shutdown: its replicas —
    ``ember engine`` processes in their own sessions, a loaded model each — ran on,
    holding memory and ports, and the next API started new ones beside them. Each now
    watches the API that started it (``--parent-pid``) and stops once it is gone."""
    env = {
        "EMBER_DATA_DIR": str(tmp_path / "data"),
        "EMBER_PORT": str(services.free_port()),
        "EMBER_POOLS_ENABLED": "true",
        "EMBER_STANDBY_REPLICAS": "1",  # one replica process, no model needed
    }
    full = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | env
    proc = subprocess.Popen([EMBER, "serve"], env=full, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    marker = f"--parent-pid\0{proc.pid}\0".encode()

    def replicas() -> list[int]:
        return [pid for pid, cmd in _cmdlines().items()
                if b"engine" in cmd and marker in cmd and _alive(pid)]  # fmt: skip

    started: list[int] = []
    try:
        services.wait_until(lambda: bool(replicas()), 120, "the standby replica")
        started = replicas()
        args = _cmdlines()[started[0]].split(b"\0")
        url = f"http://127.0.0.1:{int(args[args.index(b'--port') + 1])}/healthz"

        def serving() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url, timeout=2).status_code == 200
            return False

        services.wait_until(serving, 120, "the standby replica to serve")  # torch and all
        proc.kill()
        proc.wait(10)
        services.wait_until(lambda: not replicas(), 30, "the replica to stop")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in started:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# --- what an answer says of the server ------------------------------------------------


def test_no_answer_names_the_server_software(platform: SecurityPlatform) -> None:
    """uvicorn's ``server: uvicorn`` on every answer told a caller what runs behind the
    API and its replicas: neither sends it (answers, problems and a replica's probes)."""
    alice = platform.client(platform.alice.key)
    answers = [
        alice.post(f"/v1/models/{platform.alice.model}:predict", json={"instances": [X]}),
        alice.get("/v1/models/no-such-model"),
        platform.client(None).get("/v1/models"),
        alice.post(f"/v1/models/{platform.alice.model}:predict", content=b"{not json"),
    ]
    assert [a.status_code for a in answers] == [200, 404, 401, 400]
    replicas = alice.get(f"/v1/deployments/{platform.alice.deployment}/replicas").json()
    url = next(r["url"] for r in replicas["replicas"] if r["state"] == "ready")
    answers.append(httpx.get(f"{url}/readyz", timeout=10))
    assert answers[-1].status_code == 200
    for answer in answers:
        assert "server" not in answer.headers, (answer.request.url, answer.headers)
