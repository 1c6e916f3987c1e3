"""Kubernetes replica backend: replicas are pods of Deployments the pools controller scales.

How the per-replica interface maps onto Deployments
---------------------------------------------------
The controller thinks in replicas (launch one, stop that one); Kubernetes thinks in
Deployments (N identical pods). The backend bridges them with *slots*:

- ``launch(spec)`` makes sure the Deployment for (tenant, deployment, version, placement)
  exists (``k8s_manifests``: created once with 0 replicas, never edited), adds a slot and
  patches ``spec.replicas`` to the number of slots. It returns at once with a handle whose
  ``url`` is empty; when the ReplicaSet's new pod shows up in the pod watch it is *bound* to
  the oldest waiting slot of its Deployment (annotation ``ember.dev/replica-id``, so a
  later leader finds the same id) and the handle's ``url`` becomes ``http://<pod IP>:<port>``
  once the pod runs. The controller then reads ``/info`` there, as on the local backend.
- ``stop(handle)`` (after the controller drained it: no new requests, in-flight done)
  marks the pod ``ember.dev/draining`` (other API replicas stop routing to it) with the
  lowest ``controller.kubernetes.io/pod-deletion-cost``, scales its Deployment down by one
  — the ReplicaSet removes the cheapest pod, this one — and deletes the pod too, so the
  pod goes even where the ReplicaSet would have picked another (a not-ready one). The
  kubelet runs the ``preStop`` pause (routers drop it), then SIGTERM, then SIGKILL after
  ``EMBER_K8S_TERMINATION_GRACE_S``. ``kill`` does the same with no grace.
- ``exited(handle)`` answers from the watch cache (no API call on the event loop): the
  pod vanished (deleted, evicted, node lost), failed, its container restarted, or it is
  still not running after ``EMBER_K8S_PENDING_TIMEOUT_S`` (no node with capacity, image
  not pulled; an unpullable image at once) — with the reason in ``exit_reason`` and
  counted in ``ember_k8s_replicas_unplaced_total``. The controller then fails the replica
  (the autoscaler's promotion did not happen) and launches a replacement.

Standby pods: one standby Deployment per hardware type (``EMBER_K8S_STANDBY_ACCELERATORS``)
runs ``ember engine --standby``. When the controller assigns a version to one (its usual
``/assign`` call), ``assigned`` relabels the pod: it leaves its standby Deployment's
selector (the ReplicaSet releases it) and carries the version's labels; the controller's
standby top-up keeps the standby Deployment's size. An assigned pod is owned by no
Deployment afterwards: the controller replaces it like any other replica if it vanishes.

The replica API's secret: pods of one Deployment share its pod template, so the secret
(``ReplicaHandle.secret``, ``secrets.token_urlsafe(32)``) is made per Deployment, when the
backend creates it, and kept in Secret ``<deployment>-secret`` (owner: the Deployment, so
it is garbage-collected with it; created before the Deployment is scaled up, so no pod
starts without it). The pod reads it as ``EMBER_REPLICA_SECRET`` through a
``secretKeyRef`` — the value is in no pod spec, Deployment, annotation or log line. An
assigned standby pod keeps its standby Deployment's. A controller that did not make a
Secret (a follower, or a new leader in ``adopt``) reads it back, named by the pod's own
``secretKeyRef``; a follower reports a pod ready only once it holds the pod's secret.

API writes go through one writer thread, in order, retried with exponential backoff and
jitter on connection errors, 409 conflicts, 429 and 5xx; replica-count patches are
coalesced (the count is read when the patch is sent). Readiness: the acting controller
uses the replica's own ``/info`` (a ``/readyz`` probe alone cannot tell loading from
failed); ``observe()`` — what a controller that follows or takes over sees — also reports
the pod's Ready condition, which the kubelet sets from ``/readyz``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import queue
import random
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from ember.config import Settings
from ember.domain.spec import VersionSpec
from ember.errors import EmberError
from ember.logs import get_logger, model_context
from ember.pools.backends import k8s_manifests as m
from ember.pools.backends.base import (
    LaunchOptions,
    ObservedReplica,
    ReplicaBackend,
    ReplicaHandle,
)
from ember.registry.schemas import Placement

if TYPE_CHECKING:
    from kubernetes.client import ApiClient
    from prometheus_client import CollectorRegistry

log = get_logger(__name__)

RETRYABLE = frozenset({409, 429, 500, 502, 503, 504})
FATAL_WAITING = frozenset({"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"})
VANISHED = -1
"""``exited`` status of a pod that is gone without an exit code (deleted, node lost)."""
UNPLACED = -2
"""``exited`` status of a pod that never ran (pending too long, no pod created)."""
API_RIGHTS: frozenset[tuple[str, str, str]] = frozenset(
    {
        # (API group, resource, verb) of every call this backend makes ...
        ("apps", "deployments", "create"),  # launch: a version's or standby Deployment
        ("apps", "deployments", "list"),  # adopt: what a previous leader created
        ("apps", "deployments", "patch"),  # spec.replicas (scale up and down)
        ("", "pods", "list"),  # the watch's (re)list
        ("", "pods", "watch"),  # endpoints and readiness
        ("", "pods", "patch"),  # replica id, draining mark, deletion cost, standby relabel
        ("", "pods", "delete"),  # stop / kill
        ("", "secrets", "create"),  # the replica API's secret of a new Deployment
        ("", "secrets", "get"),  # ... read back by a follower and a new leader
        # ... and the Lease election of ember.pools.leader, on the backend's client.
        ("coordination.k8s.io", "leases", "get"),
        ("coordination.k8s.io", "leases", "create"),
        ("coordination.k8s.io", "leases", "patch"),  # renew, take over, release
    }
)
"""Kubernetes rights the API pods' service account needs in ``EMBER_K8S_NAMESPACE``
(deploy/k8s/base/api-rbac.yaml grants them; tests/kubernetes/test_manifests.py checks
that the Role covers them and that the backend and election call nothing else)."""


class KubernetesUnavailable(EmberError):
    code = "kubernetes-unavailable"
    title = "Kubernetes cluster not reachable"


def api_client(settings: Settings) -> ApiClient:
    """A client for the cluster: the in-cluster service account when running in a pod
    (and no kubeconfig is set), else the kubeconfig file and context."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if settings.k8s_kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        except config.ConfigException:
            pass  # not in a pod: the user's kubeconfig
    path = str(settings.k8s_kubeconfig) if settings.k8s_kubeconfig else None
    try:
        config.load_kube_config(path, settings.k8s_context, client_configuration=cfg)
    except (config.ConfigException, OSError) as exc:
        where = path or "~/.kube/config"
        raise KubernetesUnavailable(
            f"no in-cluster service account and no usable kubeconfig at {where}: {exc} "
            "(set EMBER_K8S_KUBECONFIG / EMBER_K8S_CONTEXT, or run "
            "`aws eks update-kubeconfig`)"
        ) from exc
    return client.ApiClient(cfg)


@dataclass
class _Slot:
    handle: ReplicaHandle
    group: str | None
    """The Deployment the pod belongs to; None once an assigned standby pod left it."""
    kind: m.ReplicaKind
    launched_at: float
    pod: str | None = None
    secret: str | None = None
    """The Secret holding the replica API's secret of the slot's pod."""
    restarts: int = 0
    status: int | None = None
    reason: str | None = None


@dataclass
class _Op:
    what: str
    call: Callable[[], object]
    missing_ok: bool = False
    exists_ok: bool = False
    not_before: float = 0.0
    context: dict[str, str] = field(default_factory=dict)


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = obj.get("metadata") or {}
    return meta


def _condition(pod: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return dict(statuses[0]) if statuses else {}


@contextlib.contextmanager
def _unlogged_body() -> Iterator[None]:
    """An API error of a call that carried or fetched a replica secret keeps no response
    body (the retry loop logs bodies; a Secret's must never reach a log line)."""
    from kubernetes.client.exceptions import ApiException

    try:
        yield
    except ApiException as exc:
        exc.body = "(not logged: a Secret call)"
        raise


def pod_ready(pod: dict[str, Any]) -> bool:
    cond = _condition(pod, "Ready")
    return bool(cond and cond.get("status") == "True")


def _gone(pod: dict[str, Any] | None) -> bool:
    if pod is None:
        return True
    meta = _meta(pod)
    if meta.get("deletionTimestamp"):
        return True
    return (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded")


def _pending_reason(pod: dict[str, Any]) -> str:
    scheduled = _condition(pod, "PodScheduled")
    if scheduled and scheduled.get("status") == "False":
        return f"{scheduled.get('reason') or 'Unschedulable'}: {scheduled.get('message') or ''}"
    waiting = (_container(pod).get("state") or {}).get("waiting") or {}
    if waiting:
        return f"{waiting.get('reason')}: {waiting.get('message') or ''}"
    return "the pod has not started"


class KubernetesBackend(ReplicaBackend):
    replicas_outlive_controller = True

    def __init__(
        self,
        settings: Settings,
        client: ApiClient | None = None,
        *,
        watch_timeout_s: float = 60.0,
        backoff_s: tuple[float, float] = (0.2, 15.0),
        coalesce_s: float = 0.05,
    ) -> None:
        from kubernetes import client as k8s

        self.client = client or api_client(settings)
        self.core = k8s.CoreV1Api(self.client)
        self.apps = k8s.AppsV1Api(self.client)
        self.namespace = settings.k8s_namespace
        self.pod = m.PodSettings(
            namespace=settings.k8s_namespace,
            image=settings.k8s_image or "",
            service_account=settings.k8s_service_account,
            config_map=settings.k8s_config_map,
            port=settings.k8s_replica_port,
            cache_dir=str(settings.weight_cache_dir),
            termination_grace_s=settings.k8s_termination_grace_s,
            metrics_port=settings.k8s_replica_metrics_port,
            tracing=m.tracing_env(settings),
        )
        self.standby_hardware = list(settings.k8s_standby_accelerators) or [m.CPU]
        self.standby_size = (settings.k8s_standby_cpu_cores, settings.k8s_standby_memory_gib)
        self.pending_timeout_s = settings.k8s_pending_timeout_s
        self.watch_timeout_s = watch_timeout_s
        self.backoff_s = backoff_s
        self.coalesce_s = coalesce_s
        self.unplaced = Counter(
            "ember_k8s_replicas_unplaced",
            "Replica pods that never ran (pending too long: no capacity, image not pulled)",
            ["hardware", "reason"],
            registry=None,
        )
        self.api_retries = Counter(
            "ember_k8s_api_retries", "Kubernetes API calls retried", ["status"], registry=None
        )
        self._cond = threading.Condition(threading.RLock())
        self._slots: dict[str, _Slot] = {}
        self._pods: dict[str, dict[str, Any]] = {}
        self._seen: dict[str, ReplicaHandle] = {}
        self._desired: dict[str, int] = {}
        self._created: set[str] = set()
        self._secrets: dict[str, str] = {}
        """Secret name -> the replica API's secret it holds (never logged)."""
        self._reading: set[str] = set()
        self._dirty: set[str] = set()
        self._ops: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self.synced = threading.Event()
        self._watch: Any = None
        self._threads = [
            threading.Thread(target=self._watch_pods, name="ember-k8s-watch", daemon=True),
            threading.Thread(target=self._write, name="ember-k8s-writer", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # --- the replica interface ----------------------------------------------------------

    def launch(self, spec: VersionSpec | None, options: LaunchOptions) -> ReplicaHandle:
        kind = self._kind(spec, options)
        manifest = m.deployment(kind, self.pod)
        group = manifest["metadata"]["name"]
        handle = ReplicaHandle(f"r-{uuid.uuid4().hex[:10]}", "", extra={"deployment": group})
        secret = m.secret_name(group)
        with self._cond:
            if group not in self._created:
                self._created.add(group)
                self._secrets.setdefault(secret, secrets.token_urlsafe(32))
                self._enqueue(_Op(f"create Deployment {group} and its Secret",
                                  self._creator(manifest), context=self._ctx(kind)))  # fmt: skip
            handle.secret = self._secrets.get(secret, "")
            slot = _Slot(handle, group, kind, time.monotonic(), secret=secret)
            self._slots[handle.replica_id] = slot
            self._scale(group, +1)
            for pod in list(self._pods.values()):
                self._bind(pod)  # a pod of this Deployment may be waiting (adopted surplus)
        with model_context(kind.model, kind.version, replica_id=handle.replica_id):
            log.info("replica pod requested", k8s_deployment=group, hardware=kind.hardware)
        return handle

    def standby_can_run(self, spec: VersionSpec) -> bool:
        """A standby pod runs the image's own ``ember``, which has no vLLM (vLLM versions
        run in its own virtualenv: ``k8s_manifests.IMAGE_VLLM_EMBER``)."""
        return spec.engine != "vllm"

    def standby_can_take(
        self, handle: ReplicaHandle, spec: VersionSpec, options: LaunchOptions
    ) -> bool:
        slot = self._slots.get(handle.replica_id)
        if slot is None or slot.pod is None:
            return False
        have, want = slot.kind.placement, options.placement or Placement()
        return (
            self.standby_can_run(spec)
            and have.accelerator == want.accelerator
            and (have.gpus == want.gpus or not want.accelerator)
            and have.cpu_cores >= want.cpu_cores
            and have.memory_gib >= want.memory_gib
        )

    def assign_query(
        self, handle: ReplicaHandle, spec: VersionSpec, options: LaunchOptions
    ) -> dict[str, Any]:
        """The tenant, so that the standby pod caches under its tenant's directory (no
        uid: the pod runs as ``m.ENGINE_UID`` from the start)."""
        return {"tenant_id": options.tenant_id}

    def assigned(self, handle: ReplicaHandle, spec: VersionSpec, options: LaunchOptions) -> None:
        with self._cond:
            slot = self._slots.get(handle.replica_id)
            if slot is None or slot.pod is None or slot.group is None:
                return
            old, pod = slot.group, slot.pod
            slot.kind = self._kind(spec, options, slot.kind.placement)
            slot.group = None
            names = {k: v for k, v in m.version_annotations(slot.kind).items() if k != m.SPEC}
            body = {"metadata": {"labels": m.assigned_labels(slot.kind), "annotations": names}}
            # Relabel first: the ReplicaSet then releases the pod (and starts a standby in
            # its place) instead of choosing a victim among its standby pods.
            self._enqueue(_Op(f"relabel pod {pod}", self._pod_patcher(pod, body),
                              missing_ok=True, context=self._ctx(slot.kind)))  # fmt: skip
            self._scale(old, -1)

    def exited(self, handle: ReplicaHandle) -> int | None:
        with self._cond:
            slot = self._slots.get(handle.replica_id)
            if slot is None:
                return VANISHED
            if slot.status is None:
                self._check(slot)
            return slot.status

    def exit_reason(self, handle: ReplicaHandle) -> str | None:
        slot = self._slots.get(handle.replica_id)
        return slot.reason if slot is not None else None

    def stop(self, handle: ReplicaHandle, grace_s: float = 10.0) -> None:
        pod = self._remove(handle, grace_s=None)
        if pod is None:
            return
        deadline = time.monotonic() + grace_s
        with self._cond:  # the API accepted the deletion (the kubelet drains the rest)
            while not _gone(self._pods.get(pod)) and not self._closed.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("replica pod not deleted yet", pod=pod, waited_s=grace_s)
                    return
                self._cond.wait(min(left, 0.5))

    def kill(self, handle: ReplicaHandle) -> None:
        self._remove(handle, grace_s=0)

    def observe(self) -> list[ObservedReplica]:
        with self._cond:
            out = []
            for name, pod in self._pods.items():
                if _gone(pod) or _meta(pod).get("annotations", {}).get(m.DRAINING):
                    continue
                ann = _meta(pod).get("annotations") or {}
                ref = m.secret_ref(pod.get("spec") or {})
                out.append(
                    ObservedReplica(
                        self._handle_of(name, pod),
                        int(ann.get("ember.dev/tenant-id", "0") or 0),
                        ann.get("ember.dev/deployment", ""),
                        ann.get("ember.dev/model", ""),
                        ann.get("ember.dev/version", ""),
                        # not callable before its secret is read back (the watch asked)
                        pod_ready(pod) and (ref is None or ref in self._secrets),
                    )
                )
            return out

    def adopt(self) -> list[ObservedReplica]:
        """Take over the pods that exist: each gets a slot (and its replica id annotated),
        and every Deployment is scaled to the pods adopted in it — pods a dead leader asked
        for but never saw are not waited for; the controller launches what is missing."""
        self.synced.wait(30)
        existing = self._call(lambda: self.apps.list_namespaced_deployment(
            self.namespace, label_selector=m.SELECTOR, _preload_content=False))  # fmt: skip
        items = [
            item
            for item in (json.loads(existing.data).get("items", []) if existing else [])
            # the API filters by label; a stand-in may not
            if (_meta(item).get("labels") or {}).get("app.kubernetes.io/managed-by") == m.MANAGED_BY
        ]
        self._read_secrets(items)
        with self._cond:
            observed = self.observe()
            for replica in observed:
                self._adopt_one(replica.handle)
            counts: dict[str, int] = {}
            for slot in self._slots.values():
                if slot.group is not None:
                    counts[slot.group] = counts.get(slot.group, 0) + 1
            for item in items:
                name = _meta(item).get("name", "")
                self._created.add(name)
                self._desired[name] = counts.get(name, 0)
                if (item.get("spec") or {}).get("replicas", 0) != self._desired[name]:
                    self._dirty.add(name)
                    self._enqueue(self._sync_op(name))
        return observed

    # --- the replica API's secrets ---------------------------------------------------------

    def _read_secrets(self, deployments: list[dict[str, Any]]) -> None:
        """Read back the secret of every pod and Deployment that exists (a new leader calls
        them and launches into them); a Deployment whose Secret is missing (its creator
        stopped in between: no pod of it can have started) gets a new one."""
        with self._cond:
            wanted: dict[str, dict[str, Any] | None] = {}
            for pod in self._pods.values():
                ref = m.secret_ref(pod.get("spec") or {})
                if ref is not None:
                    wanted[ref] = None
        for item in deployments:
            ref = m.secret_ref(((item.get("spec") or {}).get("template") or {}).get("spec") or {})
            if ref is not None:
                wanted[ref] = item
        for ref, owner in sorted(wanted.items()):
            if ref not in self._secrets:
                op = _Op(f"read Secret {ref}", functools.partial(self._recover, ref, owner))
                self._call(op.call, op)

    def _recover(self, name: str, owner: dict[str, Any] | None) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self._fetch_secret(name)
        except ApiException as exc:
            if exc.status != 404 or owner is None:
                raise
            self._ensure_secret(owner)

    def _fetch_secret(self, name: str) -> None:
        with _unlogged_body():  # not preloaded: the client logs a preloaded body (DEBUG)
            response = self.core.read_namespaced_secret(
                name, self.namespace, _preload_content=False
            )
        try:
            value = m.secret_value(json.loads(response.data))
        except (KeyError, ValueError, TypeError):
            log.error("replica Secret holds no secret; its pods cannot be called", secret=name,
                      key=m.SECRET_KEY)  # fmt: skip
            return
        with self._cond:
            self._learn(name, value)

    def _ensure_secret(self, owner: dict[str, Any]) -> None:
        """Create the Secret of Deployment ``owner``; if it exists already (made by a
        previous leader, or by this call before a lost response), adopt its value."""
        from kubernetes.client.exceptions import ApiException

        name = m.secret_name(_meta(owner)["name"])
        with self._cond:
            value = self._secrets.setdefault(name, secrets.token_urlsafe(32))
        try:
            with _unlogged_body():  # not preloaded: the client logs a preloaded body (DEBUG)
                response = self.core.create_namespaced_secret(
                    self.namespace, m.replica_secret(owner, value), _preload_content=False
                )
                response.read()  # and the connection goes back to the pool
        except ApiException as exc:
            if exc.status != 409:
                raise
            self._fetch_secret(name)

    def _learn(self, name: str, value: str) -> None:
        """Secret ``name`` holds ``value``: every handle of a pod that reads it gets it."""
        self._secrets[name] = value
        for slot in self._slots.values():
            if slot.secret == name:
                slot.handle.secret = value
        for pod_name, handle in self._seen.items():
            if m.secret_ref((self._pods.get(pod_name) or {}).get("spec") or {}) == name:
                handle.secret = value

    def _want_secret(self, pod: dict[str, Any]) -> None:
        """A pod whose secret this controller does not hold: the writer reads it back."""
        ref = m.secret_ref(pod.get("spec") or {})
        if ref is None or ref in self._secrets or ref in self._reading:
            return
        self._reading.add(ref)

        def read() -> None:
            try:
                self._fetch_secret(ref)
            finally:
                with self._cond:
                    self._reading.discard(ref)  # after an error: asked again by a later event

        self._enqueue(_Op(f"read Secret {ref}", read))

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(self.unplaced)
        registry.register(self.api_retries)

    def close(self) -> None:
        """Stop the watch and the writer (pending writes are dropped; replicas stay)."""
        self._closed.set()
        self._ops.put(None)
        deadline = time.monotonic() + 5
        for thread in self._threads:
            while thread.is_alive() and time.monotonic() < deadline:
                self._interrupt_watch()  # again: a watch may have (re)started meanwhile
                thread.join(0.05)
        with self._cond:
            self._cond.notify_all()
        self.client.close()

    def _interrupt_watch(self) -> None:
        watch = self._watch
        if watch is None:
            return
        watch.stop()
        response = getattr(watch, "_resp", None)
        if response is not None and hasattr(response, "shutdown"):
            with contextlib.suppress(OSError, ValueError, RuntimeError):  # already closed
                response.shutdown()  # unblocks the watch's read at once

    # --- slots --------------------------------------------------------------------------

    def _kind(
        self,
        spec: VersionSpec | None,
        options: LaunchOptions,
        placement: Placement | None = None,
    ) -> m.ReplicaKind:
        if spec is None:
            placement = placement or self._standby_placement()
            return m.ReplicaKind(0, "", "", "", None, placement, (32, 5.0, 1024))
        return m.ReplicaKind(
            options.tenant_id,
            options.deployment,
            spec.model,
            spec.version,
            spec,
            placement or options.placement or Placement(),
            (options.max_batch_size, options.max_queue_delay_ms, options.max_queue),
        )

    def _standby_placement(self) -> Placement:
        """The hardware type with the fewest standby slots gets the next standby pod."""
        counts = {hw: 0 for hw in self.standby_hardware}
        for slot in self._slots.values():
            if slot.kind.spec is None and slot.kind.hardware in counts:
                counts[slot.kind.hardware] += 1
        hardware = min(self.standby_hardware, key=lambda hw: counts[hw])
        cpu_cores, memory_gib = self.standby_size
        accelerator = None if hardware == m.CPU else hardware
        return Placement(accelerator=accelerator, cpu_cores=cpu_cores, memory_gib=memory_gib)

    @staticmethod
    def _ctx(kind: m.ReplicaKind) -> dict[str, str]:
        return {"model": kind.model, "version": kind.version}

    def _remove(self, handle: ReplicaHandle, grace_s: int | None) -> str | None:
        with self._cond:
            slot = self._slots.pop(handle.replica_id, None)
            if slot is None:
                return None
            pod = slot.pod if slot.pod in self._pods else None
            ctx = self._ctx(slot.kind)
            if pod is not None:
                marks = {m.DRAINING: "true", m.DELETION_COST: "-1000"}
                body = {"metadata": {"annotations": marks}}
                self._enqueue(_Op(f"mark pod {pod} draining", self._pod_patcher(pod, body),
                                  missing_ok=True, context=ctx))  # fmt: skip
            if slot.group is not None:
                self._scale(slot.group, -1)
            if pod is not None:
                self._enqueue(_Op(f"delete pod {pod}", self._pod_deleter(pod, grace_s),
                                  missing_ok=True, context=ctx))  # fmt: skip
            return pod

    def _scale(self, group: str, delta: int) -> None:
        self._desired[group] = max(0, self._desired.get(group, 0) + delta)
        if group not in self._dirty:
            self._dirty.add(group)
            self._enqueue(self._sync_op(group))

    def _sync_op(self, group: str) -> _Op:
        def sync() -> None:
            with self._cond:
                self._dirty.discard(group)
                want = self._desired.get(group, 0)
            self.apps.patch_namespaced_deployment(group, self.namespace,
                                                  {"spec": {"replicas": want}})  # fmt: skip

        soon = time.monotonic() + self.coalesce_s  # launches in the same tick share a patch
        return _Op(f"scale Deployment {group}", sync, not_before=soon)

    def _adopt_one(self, handle: ReplicaHandle) -> None:
        name = handle.extra.get("pod")
        pod = self._pods.get(name or "")
        if name is None or pod is None or handle.replica_id in self._slots:
            return
        ann, labels = _meta(pod).get("annotations") or {}, _meta(pod).get("labels") or {}
        spec = VersionSpec.model_validate_json(ann[m.SPEC]) if m.SPEC in ann else None
        model = ann.get("ember.dev/model", "")
        if spec is None and model:  # an assigned standby pod: the spec went by /assign;
            # only its names are known here (all the slot needs of it)
            version = ann.get("ember.dev/version", "")
            spec = VersionSpec(model=model, version=version, artifact_uri="", sha256="", engine="")
        hardware = labels.get("ember.dev/hardware", m.CPU)
        cpu_cores, memory_gib = self.standby_size  # what a standby pod of it would take
        accelerator = None if hardware == m.CPU else hardware
        placement = Placement(accelerator=accelerator, cpu_cores=cpu_cores, memory_gib=memory_gib)
        options = LaunchOptions(
            tenant_id=int(ann.get("ember.dev/tenant-id", "0") or 0),
            deployment=ann.get("ember.dev/deployment", ""),
        )
        kind = self._kind(spec, options, placement)
        slot = _Slot(handle, labels.get(m.GROUP), kind, time.monotonic())
        slot.pod, slot.restarts = name, int(_container(pod).get("restartCount", 0))
        slot.secret = m.secret_ref(pod.get("spec") or {})
        self._slots[handle.replica_id] = slot
        if ann.get(m.REPLICA_ID) != handle.replica_id:
            body = {"metadata": {"annotations": {m.REPLICA_ID: handle.replica_id}}}
            self._enqueue(_Op(f"annotate pod {name}", self._pod_patcher(name, body),
                              missing_ok=True, context=self._ctx(slot.kind)))  # fmt: skip

    def _handle_of(self, name: str, pod: dict[str, Any]) -> ReplicaHandle:
        for slot in self._slots.values():
            if slot.pod == name:
                return slot.handle
        ann = _meta(pod).get("annotations") or {}
        replica_id = ann.get(m.REPLICA_ID) or name
        handle = self._seen.get(name)
        if handle is None or handle.replica_id != replica_id:
            handle = self._seen[name] = ReplicaHandle(replica_id, "", extra={"pod": name})
        handle.url = self._url(pod)
        ref = m.secret_ref(pod.get("spec") or {})
        if ref is not None and ref in self._secrets:
            handle.secret = self._secrets[ref]
        return handle

    def _url(self, pod: dict[str, Any]) -> str:
        ip = (pod.get("status") or {}).get("podIP")
        running = (pod.get("status") or {}).get("phase") == "Running"
        return f"http://{ip}:{self.pod.port}" if ip and running and not _gone(pod) else ""

    def _bind(self, pod: dict[str, Any]) -> None:
        """Give a new pod to the oldest slot of its Deployment still waiting for one."""
        meta = _meta(pod)
        name, group = meta.get("name", ""), (meta.get("labels") or {}).get(m.GROUP)
        if _gone(pod) or any(s.pod == name for s in self._slots.values()):
            return
        waiting = [s for s in self._slots.values() if s.group == group and s.pod is None]
        if group is None or not waiting:
            return
        slot = min(waiting, key=lambda s: s.launched_at)
        slot.pod, slot.restarts = name, int(_container(pod).get("restartCount", 0))
        slot.handle.extra["pod"] = name
        body = {"metadata": {"annotations": {m.REPLICA_ID: slot.handle.replica_id}}}
        self._enqueue(_Op(f"annotate pod {name}", self._pod_patcher(name, body),
                          missing_ok=True, context=self._ctx(slot.kind)))  # fmt: skip

    def _check(self, slot: _Slot) -> None:
        """Whether the slot's pod is gone, failed, restarted or stuck (sets ``status``)."""
        age = time.monotonic() - slot.launched_at
        if slot.pod is None:
            if age > self.pending_timeout_s:
                self._unplaced(slot, f"no pod was created for Deployment {slot.group} "
                               f"within {self.pending_timeout_s:g} s (kubectl describe "
                               f"deployment {slot.group})", "NoPod")  # fmt: skip
            return
        pod = self._pods.get(slot.pod)
        if _gone(pod):
            self._vanished(slot, pod)
            return
        assert pod is not None
        container = _container(pod)
        if int(container.get("restartCount", 0)) > slot.restarts:
            last = (container.get("lastState") or {}).get("terminated") or {}
            slot.status = int(last.get("exitCode", VANISHED))
            slot.reason = (f"container of pod {slot.pod} exited ({last.get('reason')}, "
                           f"code {slot.status}) and was restarted")  # fmt: skip
            return
        waiting = ((container.get("state") or {}).get("waiting") or {}).get("reason")
        running = (pod.get("status") or {}).get("phase") == "Running"
        if waiting in FATAL_WAITING or (not running and age > self.pending_timeout_s):
            reason = _pending_reason(pod)
            self._unplaced(slot, f"pod {slot.pod} did not start: {reason}", reason.split(":")[0])

    def _vanished(self, slot: _Slot, pod: dict[str, Any] | None) -> None:
        terminated = (_container(pod or {}).get("state") or {}).get("terminated") or {}
        slot.status = int(terminated.get("exitCode", VANISHED))
        phase = ((pod or {}).get("status") or {}).get("phase")
        why = pod and ((pod.get("status") or {}).get("reason") or phase)
        slot.reason = f"pod {slot.pod} vanished ({why or 'deleted, evicted or its node lost'})"
        with model_context(slot.kind.model, slot.kind.version, replica_id=slot.handle.replica_id):
            log.warning("replica pod vanished", pod=slot.pod, reason=slot.reason)

    def _unplaced(self, slot: _Slot, reason: str, short: str) -> None:
        slot.status, slot.reason = UNPLACED, reason
        self.unplaced.labels(hardware=slot.kind.hardware, reason=short[:40]).inc()
        with model_context(slot.kind.model, slot.kind.version, replica_id=slot.handle.replica_id):
            log.warning("replica pod did not start", reason=reason)

    # --- the pod watch ------------------------------------------------------------------

    def _watch_pods(self) -> None:
        from kubernetes import watch

        version: str | None = None
        delay = self.backoff_s[0]
        while not self._closed.is_set():
            try:
                if version is None:
                    version = self._relist()
                self._watch = watch.Watch()
                stream = self._watch.stream(
                    self.core.list_namespaced_pod,
                    self.namespace,
                    label_selector=m.SELECTOR,
                    resource_version=version,
                    timeout_seconds=int(self.watch_timeout_s),
                    _request_timeout=self.watch_timeout_s + 10,
                )
                for event in stream:
                    self._on_pod(event["type"], event["raw_object"])
                    delay = self.backoff_s[0]
                version = self._watch.resource_version if self._watch else None
            except Exception as exc:  # the watch must outlive any API or network error
                if self._closed.is_set():
                    return
                status = getattr(exc, "status", None)
                version = None  # 410 Gone or a broken stream: list again
                log.warning("pod watch broken; listing again", status=status, error=str(exc),
                            retry_in_s=round(delay, 2))  # fmt: skip
                self._closed.wait(delay)
                delay = min(delay * 2, self.backoff_s[1])

    def _relist(self) -> str | None:
        response = self.core.list_namespaced_pod(
            self.namespace, label_selector=m.SELECTOR, _preload_content=False
        )
        body = json.loads(response.data)
        items = {_meta(p).get("name", ""): p for p in body.get("items", []) if self._ours(p)}
        with self._cond:
            for name in set(self._pods) - set(items):
                self._on_pod("DELETED", self._pods[name])
            for pod in items.values():
                self._on_pod("MODIFIED", pod)
        self.synced.set()
        version = _meta(body).get("resourceVersion")
        return str(version) if version else None

    @staticmethod
    def _ours(pod: dict[str, Any]) -> bool:
        labels = _meta(pod).get("labels") or {}
        return bool(labels.get("app.kubernetes.io/managed-by") == m.MANAGED_BY)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        if not self._ours(pod):
            return  # a label selector the server (or a stand-in) did not apply
        name = _meta(pod).get("name", "")
        with self._cond:
            if kind == "DELETED":
                self._pods.pop(name, None)
                self._seen.pop(name, None)
            else:
                self._pods[name] = pod
                self._bind(pod)
                if not _gone(pod):
                    self._want_secret(pod)
            for slot in self._slots.values():
                if slot.pod == name:
                    slot.handle.url = self._url(pod) if kind != "DELETED" else ""
            self._cond.notify_all()

    # --- the writer: every API write, in order, retried ----------------------------------

    def _enqueue(self, op: _Op) -> None:
        self._ops.put(op)

    def _creator(self, manifest: dict[str, Any]) -> Callable[[], object]:
        """Create the Deployment (0 replicas), then its Secret (owned by it); the scale-up
        is queued after this, so no pod starts before its secret exists."""
        from kubernetes.client.exceptions import ApiException

        name = manifest["metadata"]["name"]

        def create() -> None:
            try:
                response = self.apps.create_namespaced_deployment(
                    self.namespace, manifest, _preload_content=False
                )
                owner = json.loads(response.data)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                owner = self._deployment(name)  # a previous leader's, or ours before a retry
            self._ensure_secret(owner)

        return create

    def _deployment(self, name: str) -> dict[str, Any]:
        response = self.apps.list_namespaced_deployment(
            self.namespace, field_selector=f"metadata.name={name}", _preload_content=False
        )
        for item in json.loads(response.data).get("items", []):
            if _meta(item).get("name") == name:  # the API filters by name; a stand-in may not
                return dict(item)
        raise LookupError(f"Deployment {name} exists and is not listed")  # retried

    def _pod_patcher(self, pod: str, body: dict[str, Any]) -> Callable[[], object]:
        return lambda: self.core.patch_namespaced_pod(pod, self.namespace, body)

    def _pod_deleter(self, pod: str, grace_s: int | None) -> Callable[[], object]:
        return lambda: self.core.delete_namespaced_pod(
            pod, self.namespace, grace_period_seconds=grace_s
        )

    def _write(self) -> None:
        while True:
            op = self._ops.get()
            if op is None or self._closed.is_set():
                return
            wait = op.not_before - time.monotonic()
            if wait > 0:
                self._closed.wait(wait)
            self._apply(op)

    def _apply(self, op: _Op) -> None:
        with model_context(op.context.get("model", ""), op.context.get("version", "")):
            self._call(op.call, op)

    def _call(self, call: Callable[[], Any], op: _Op | None = None) -> Any:
        """``call()``, retried with exponential backoff and full jitter while the error is
        transient; None after a permanent error (logged) or when the backend closes."""
        from kubernetes.client.exceptions import ApiException

        what = op.what if op else "list Deployments"
        delay = self.backoff_s[0]
        while not self._closed.is_set():
            try:
                return call()
            except ApiException as exc:
                if (exc.status == 404 and op and op.missing_ok) or (
                    exc.status == 409 and op and op.exists_ok
                ):
                    return None
                if exc.status not in RETRYABLE:
                    log.error("kubernetes API call failed", call=what, status=exc.status,
                              reason=exc.reason, body=str(exc.body)[:500])  # fmt: skip
                    return None
                status = str(exc.status)
            except Exception as exc:  # connection refused, reset, timeout: retried
                status = type(exc).__name__
            self.api_retries.labels(status=status).inc()
            pause = random.uniform(0, delay)
            log.warning("kubernetes API call failed; retrying", call=what, status=status,
                        retry_in_s=round(pause, 3))  # fmt: skip
            self._closed.wait(pause)
            delay = min(delay * 2, self.backoff_s[1])
        return None
