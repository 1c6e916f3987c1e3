"""A Kubernetes stand-in for the backend tests: ``kmock`` (an in-memory API server the
official client talks HTTP to) plus a fake cluster loop of our own.

kmock stores objects and streams watches, but runs no controllers: nothing turns a
Deployment's replicas into pods. ``FakeCluster`` plays the ReplicaSet controller, the
scheduler and the kubelet — it creates and deletes Pod objects in kmock to match each
Deployment's ``spec.replicas`` (deletion cost and readiness pick the victims, like the
real ReplicaSet), gives each running pod its own loopback IP (127.0.0.N) with a tiny HTTP
server answering the replica API (``/info``, ``/readyz``, ``/healthz``, ``/assign``,
``/tier``; every route but the probes ``/healthz`` and ``/readyz`` requires the pod's
``EMBER_REPLICA_SECRET`` in ``X-Ember-Replica-Secret``, which the fake kubelet resolves
from the pod's ``secretKeyRef`` as the real one does — a pod whose Secret does not exist
waits in ``CreateContainerConfigError``), sets the pod's phase and Ready condition, keeps
a pod Pending (``Unschedulable``) where told to, and finishes graceful deletions (a
finalizer stands in for the kubelet's termination). kmock gives created objects no ``metadata.uid``;
``Emulator`` does, as the API server would (owner references name it). Nothing here is a
real cluster.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import itertools
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kmock
import pytest
from kmock._internal import enums, parsing, rendering
from kubernetes import client

from ember.config import Settings
from ember.domain.spec import REPLICA_SECRET_ENV, REPLICA_SECRET_HEADER
from ember.pools.backends import k8s_manifests as m
from ember.pools.backends.kubernetes import KubernetesBackend

NAMESPACE = "ember"
FINALIZER = "tests.ember.dev/kubelet"
_guess = parsing.guess_k8s


def _guess_k8s(k8s: Any, method: Any, query: dict[str, str]) -> Any:
    # The official client sends ``watch=True``; the API server parses it like ``true``,
    # kmock only knows the lowercase form.
    return _guess(k8s, method, {**query, "watch": str(query.get("watch", "")).lower()})


parsing.guess_k8s = _guess_k8s


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator, stamping a ``metadata.uid`` on every object it creates."""

    async def _handle(self, request: rendering.Request) -> Any:
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            request.data.setdefault("metadata", {}).setdefault("uid", str(uuid.uuid4()))
        return await super()._handle(request)


@contextlib.contextmanager
def kmock_server() -> Iterator[tuple[str, kmock.KubernetesEmulator]]:
    """kmock's emulator on a loopback port, in its own thread and event loop."""
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def main() -> None:
        async with Emulator() as handler, kmock.Server(handler) as server:
            for resource in ("v1/pods", "v1/secrets", "apps/v1/deployments",
                             "coordination.k8s.io/v1/leases"):  # fmt: skip
                handler.resources[resource] = {}
            state.update(handler=handler, url=str(server.url).rstrip("/"))
            state["stop"] = asyncio.Event()
            state["loop"] = asyncio.get_running_loop()
            ready.set()
            await state["stop"].wait()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert ready.wait(10), "kmock did not start"
    try:
        yield state["url"], state["handler"]
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(10)


def api_client(url: str) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = url
    return client.ApiClient(cfg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))  # free on every loopback address
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = 10.0) -> Any:
    """Poll ``check`` until it returns something truthy (a deadline, not a sleep)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class FakeReplica:
    """The replica API of one pod, as ``ember engine`` answers it (no model behind): every
    route but the probes needs ``secret`` (None: the pod was given none) in the header."""

    def __init__(self, ip: str, port: int, standby: bool, secret: str | None) -> None:
        self.state = "standby" if standby else "ready"
        self.tier = "hot"
        self.secret = secret
        self.rejected: list[str] = []
        """Calls refused for a missing or wrong secret (their paths)."""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if self.path in ("/healthz", "/readyz") or owner.secret is None:
                    return True
                given = self.headers.get(REPLICA_SECRET_HEADER) or ""
                if hmac.compare_digest(given.encode(), owner.secret.encode()):
                    return True
                owner.rejected.append(self.path)
                self._send(401, {"title": "Unauthorized", "status": 401})
                return False

            def do_GET(self) -> None:
                if not self._authorized():
                    return
                info = {"state": owner.state, "tier": owner.tier}
                if self.path == "/readyz":
                    ok = owner.state == "ready" and owner.tier == "hot"
                    self._send(200 if ok else 503, info)
                else:
                    self._send(200, {"status": "ok", **info})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self._authorized():
                    return
                if self.path.partition("?")[0] == "/assign":  # the query: the batch policy
                    owner.state = "ready"
                elif self.path == "/tier":
                    owner.tier = body["tier"]
                self._send(200, {"state": owner.state, "tier": owner.tier})

        self.server = ThreadingHTTPServer((ip, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def ready(self) -> bool:
        return self.state in ("ready", "standby") and (
            self.state == "standby" or self.tier == "hot"
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = obj.get("metadata") or {}
    return meta


class FakeCluster:
    """ReplicaSet controller + scheduler + kubelet over kmock (see the module docstring)."""

    def __init__(self, url: str, port: int) -> None:
        self.api = api_client(url)
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.port = port
        self.unschedulable: set[str] = set()
        """Accelerators with no node: their pods stay Pending."""
        self.replicas: dict[str, FakeReplica] = {}
        self.config_errors: list[str] = []
        """Pods that waited for a Secret that did not exist (CreateContainerConfigError)."""
        self._ips = (f"127.0.0.{n}" for n in itertools.count(2))
        self._names = itertools.count(1)
        self._stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _list(self, fn: Callable[..., Any]) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = json.loads(fn(NAMESPACE, _preload_content=False).data)[
            "items"
        ]
        return items

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                self.step()
            self._stop.wait(0.02)

    def step(self) -> None:
        pods = self._list(self.core.list_namespaced_pod)
        for deployment in self._list(self.apps.list_namespaced_deployment):
            self._replicate(deployment, pods)
        for pod in pods:
            self._kubelet(pod)

    def _replicate(self, deployment: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        name = _meta(deployment)["name"]
        mine = [
            p
            for p in pods
            if (_meta(p).get("labels") or {}).get(m.GROUP) == name
            and not _meta(p).get("deletionTimestamp")
        ]
        want = int(deployment["spec"].get("replicas") or 0)
        for _ in range(want - len(mine)):
            template = deployment["spec"]["template"]
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    **template["metadata"],
                    "name": f"{name}-{next(self._names):05d}",
                    "namespace": NAMESPACE,
                    "finalizers": [FINALIZER],
                    "creationTimestamp": datetime.now(UTC).isoformat(),
                },
                "spec": template["spec"],
            }
            self.core.create_namespaced_pod(NAMESPACE, pod)

        def victim_rank(p: dict[str, Any]) -> tuple[int, int, str]:
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or []
            )
            cost = int((_meta(p).get("annotations") or {}).get(m.DELETION_COST, "0"))
            return (int(ready), cost, _meta(p).get("creationTimestamp", ""))

        surplus = sorted(mine, key=victim_rank)[: max(0, len(mine) - want)]
        for pod in surplus:
            with contextlib.suppress(client.ApiException):
                self.core.delete_namespaced_pod(_meta(pod)["name"], NAMESPACE)

    def _kubelet(self, pod: dict[str, Any]) -> None:
        name = _meta(pod)["name"]
        if _meta(pod).get("deletionTimestamp"):
            self._terminate(name)
            return
        status = pod.get("status") or {}
        accelerator = (pod["spec"].get("nodeSelector") or {}).get("ember.dev/accelerator")
        if not status and accelerator in self.unschedulable:
            message = f"0/3 nodes are available: 3 Insufficient {m.GPU_TAINT}."
            cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": message}  # fmt: skip
            self._status(name, {"phase": "Pending", "conditions": [cond]})
            return
        if accelerator in self.unschedulable:
            return
        replica = self.replicas.get(name)
        if replica is None:
            secret = self._secret_of(pod)
            if secret is False:  # the real kubelet retries too, and starts it once it exists
                if name not in self.config_errors:
                    self.config_errors.append(name)
                if not status:
                    waiting = {"reason": "CreateContainerConfigError",
                               "message": "secret not found"}  # fmt: skip
                    container = {"name": "engine", "ready": False, "restartCount": 0,
                                 "image": "ember", "imageID": "",
                                 "state": {"waiting": waiting}}  # fmt: skip
                    self._status(name, {"phase": "Pending", "containerStatuses": [container]})
                return
            standby = "--standby" in pod["spec"]["containers"][0]["args"]
            ip = next(self._ips)
            replica = self.replicas[name] = FakeReplica(ip, self.port, standby, secret or None)
            self._status(name, self._running(ip, replica.ready))
            return
        was = any(c.get("type") == "Ready" and c["status"] == "True" for c in status["conditions"])
        if was != replica.ready:
            self._status(name, self._running(status["podIP"], replica.ready))

    def _secret_of(self, pod: dict[str, Any]) -> str | bool | None:
        """``EMBER_REPLICA_SECRET`` of the pod, resolved from its ``secretKeyRef`` (None: the
        pod has none; False: its Secret or key does not exist)."""
        for env in pod["spec"]["containers"][0].get("env") or []:
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            if env["name"] != REPLICA_SECRET_ENV or not ref:
                continue
            try:
                response = self.core.read_namespaced_secret(ref["name"], NAMESPACE,
                                                            _preload_content=False)  # fmt: skip
            except client.ApiException:
                return False
            data = json.loads(response.data).get("data") or {}
            if ref["key"] not in data:
                return False
            return base64.b64decode(data[ref["key"]]).decode()
        return None

    def secrets(self) -> dict[str, dict[str, Any]]:
        return {_meta(s)["name"]: s for s in self._list(self.core.list_namespaced_secret)}

    @staticmethod
    def _running(ip: str, ready: bool) -> dict[str, Any]:
        return {
            "phase": "Running",
            "podIP": ip,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": str(ready)},
            ],
            "containerStatuses": [
                {
                    "name": "engine",
                    "ready": ready,
                    "restartCount": 0,
                    "image": "ember",
                    "imageID": "",
                    "state": {"running": {}},
                }
            ],
        }

    def _status(self, name: str, status: dict[str, Any]) -> None:
        with contextlib.suppress(client.ApiException):
            self.core.patch_namespaced_pod(name, NAMESPACE, {"status": status})

    def _terminate(self, name: str) -> None:
        replica = self.replicas.pop(name, None)
        if replica is not None:
            replica.close()
        with contextlib.suppress(client.ApiException):
            self.core.patch_namespaced_pod(name, NAMESPACE, {"metadata": {"finalizers": None}})

    def lose_node_of(self, pod: str) -> None:
        """The pod's node is gone: the pod disappears with no goodbye."""
        with self.lock:
            replica = self.replicas.pop(pod, None)
            if replica is not None:
                replica.close()
            self.core.patch_namespaced_pod(pod, NAMESPACE, {"metadata": {"finalizers": None}})
            self.core.delete_namespaced_pod(pod, NAMESPACE, grace_period_seconds=0)

    def pods(self) -> list[dict[str, Any]]:
        return self._list(self.core.list_namespaced_pod)

    def deployments(self) -> dict[str, dict[str, Any]]:
        return {_meta(d)["name"]: d for d in self._list(self.apps.list_namespaced_deployment)}

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        for replica in self.replicas.values():
            replica.close()
        self.api.close()


def k8s_settings(data_dir: Path, port: int, **extra: Any) -> Settings:
    return Settings(
        data_dir=data_dir,
        replica_backend="kubernetes",
        k8s_namespace=NAMESPACE,
        k8s_image="ember:test",
        cache_dir=Path("/mnt/nvme/ember-cache"),
        k8s_replica_port=port,
        **extra,
    )


@pytest.fixture
def kube() -> Iterator[tuple[str, kmock.KubernetesEmulator]]:
    with kmock_server() as server:
        yield server


@pytest.fixture
def cluster(kube: tuple[str, kmock.KubernetesEmulator]) -> Iterator[FakeCluster]:
    fake = FakeCluster(kube[0], free_port())
    yield fake
    fake.close()


@pytest.fixture
def make_backend(
    kube: tuple[str, kmock.KubernetesEmulator], cluster: FakeCluster, data_dir: Path
) -> Iterator[Callable[..., KubernetesBackend]]:
    made: list[KubernetesBackend] = []

    def make(**extra: Any) -> KubernetesBackend:
        backend = KubernetesBackend(
            k8s_settings(data_dir, cluster.port, **extra),
            api_client(kube[0]),
            watch_timeout_s=5,
            backoff_s=(0.01, 0.1),
        )
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()
