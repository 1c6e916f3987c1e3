"""The Kubernetes objects the replica backend creates, as plain dicts (pure functions; the
tests validate every one with ``kubernetes-validate --strict``).

One Deployment per (tenant, Ember deployment, model version, tier) and placement: a
*version* Deployment runs ``ember engine --spec-file`` for one version; a *standby*
Deployment per hardware type runs ``ember engine --standby`` (runtime imported, no weights).
A Deployment's pod template never changes after it is created: its name ends in a digest
of the whole template, so a changed policy or spec makes a new Deployment for new replicas
instead of rolling (restarting) the running ones.

Every replica pod runs with least privilege: a fixed unprivileged UID/GID, a read-only root
filesystem (writable emptyDirs for ``/tmp``, ``$HOME`` and the kernel caches, the data
directory), no capabilities, no privilege escalation, the RuntimeDefault seccomp profile
and no service-account token (the EKS IRSA webhook still injects its own AWS web-identity
token). The replica API's secret (``EMBER_REPLICA_SECRET``) comes from a Secret of its
Deployment (``replica_secret``, owned by the Deployment) by ``secretKeyRef``: never inline
in the pod spec.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.domain.spec import REPLICA_SECRET_ENV, VersionSpec
from ember.registry.schemas import Placement

if TYPE_CHECKING:
    from ember.config import Settings

MANAGED_BY = "ember-pools"
GROUP = "ember.dev/group"
"""Selector label: the name of the Deployment a pod belongs to (absent on a standby pod
that was assigned a version: it left its standby Deployment)."""
REPLICA_ID = "ember.dev/replica-id"
SPEC = "ember.dev/spec"
DRAINING = "ember.dev/draining"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"
CPU = "cpu"
GPU_TAINT = "nvidia.com/gpu"
DATA_DIR = "/var/lib/ember"
SPEC_DIR = "/etc/ember/spec"
HOME_DIR = "/home/ember"
"""The engine's ``$HOME`` (an emptyDir: the root filesystem is read-only); the caches that
torch, Triton, CUDA, Hugging Face and vLLM write by default live under it, per pod."""
ENGINE_UID = 10001
"""The UID and GID replica pods run as; the GPU node bootstrap (infra/terraform
``cache_owner_uid``) chowns the NVMe cache directory to it, since a ``hostPath`` volume
is not chowned by ``fsGroup``."""
SECRET_KEY = "secret"  # noqa: S105 - a key name, not a secret
"""The key of the replica API's secret in its Secret (``replica_secret``)."""
PRE_STOP_S = 5
"""The pod keeps serving this long after it is marked for deletion, so that every API
replica's router has dropped it before the engine stops accepting requests."""


@dataclass(frozen=True)
class PodSettings:
    """The cluster-wide part of every replica pod (from ``Settings``)."""

    namespace: str
    image: str
    service_account: str
    config_map: str
    port: int
    cache_dir: str
    termination_grace_s: int
    metrics_port: int | None = None
    """The replica's own ``/metrics`` without the secret (``EMBER_K8S_REPLICA_METRICS_PORT``):
    a ``metrics`` container port and ``prometheus.io/*`` annotations; None: neither."""
    tracing: tuple[tuple[str, str], ...] = ()
    """``EMBER_OTEL_*`` the replicas inherit (all but ``EMBER_OTEL_HEADERS``: replicas run
    tenants' code and never see the collector's key)."""


@dataclass(frozen=True)
class ReplicaKind:
    """What a Deployment runs: one version of one Ember deployment, or standby."""

    tenant_id: int
    deployment: str
    model: str
    version: str
    spec: VersionSpec | None
    """None: standby."""
    placement: Placement
    batch: tuple[int, float, int]
    """max_batch_size, max_queue_delay_ms, max_queue."""

    @property
    def tier(self) -> str:
        return "standby" if self.spec is None else "hot"

    @property
    def hardware(self) -> str:
        return self.placement.accelerator or CPU


def label_value(text: str) -> str:
    """A label-safe rendering of a name (versions may hold ``+``); exact names are kept in
    annotations."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text)[:63]
    return cleaned.strip("._-") or "x"


def _slug(text: str, size: int) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:size].strip("-") or "x"


def threads_of(placement: Placement) -> int:
    return placement.threads or max(1, math.ceil(placement.cpu_cores))


def _resources(placement: Placement) -> dict[str, Any]:
    amounts: dict[str, Any] = {
        "cpu": f"{round(placement.cpu_cores * 1000)}m",
        "memory": f"{round(placement.memory_gib * 1024)}Mi",
    }
    if placement.accelerator and placement.gpus:
        amounts[GPU_TAINT] = placement.gpus
    return {"requests": amounts, "limits": dict(amounts)}


def _args(kind: ReplicaKind, pod: PodSettings) -> list[str]:
    size, delay_ms, queue = kind.batch
    args = ["engine", "--host", "0.0.0.0", "--port", str(pod.port),
            "--replica-id", "$(POD_NAME)", "--threads", str(threads_of(kind.placement)),
            "--max-batch-size", str(size), "--max-queue-delay-ms", f"{delay_ms:g}",
            "--max-queue", str(queue)]  # fmt: skip
    if kind.placement.accelerator and kind.placement.gpus:
        args += ["--device", "cuda"]
    served = ["--spec-file", f"{SPEC_DIR}/spec.json"] if kind.spec is not None else ["--standby"]
    return [*args, *served]


def tracing_env(settings: Settings) -> tuple[tuple[str, str], ...]:
    """The ``EMBER_OTEL_*`` settings a replica pod runs with: off unless the API's is on;
    never the collector's headers (a secret)."""
    if settings.otel_endpoint is None:
        return ()
    env = [
        ("EMBER_OTEL_ENDPOINT", settings.otel_endpoint),
        ("EMBER_OTEL_SAMPLE_RATIO", repr(settings.otel_sample_ratio)),
        ("EMBER_OTEL_EXPORT_DELAY_MS", str(settings.otel_export_delay_ms)),
        ("EMBER_OTEL_TIMEOUT_S", repr(settings.otel_timeout_s)),
    ]
    if settings.otel_service_name:
        env.append(("EMBER_OTEL_SERVICE_NAME", settings.otel_service_name))
    return tuple(env)


def _env(kind: ReplicaKind, pod: PodSettings) -> list[dict[str, Any]]:
    threads = str(threads_of(kind.placement))
    # A version's replica caches under its tenant's directory (a standby pod moves there on
    # /assign, which names the tenant): ember.loader.cache.tenant_cache_dir.
    cache = pod.cache_dir if kind.spec is None else f"{pod.cache_dir}/t{int(kind.tenant_id)}"
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "OMP_NUM_THREADS", "value": threads},
        {"name": "MKL_NUM_THREADS", "value": threads},
        {"name": "EMBER_CACHE_DIR", "value": cache},
        {"name": "EMBER_DATA_DIR", "value": DATA_DIR},
        {"name": "EMBER_LOG_FORMAT", "value": "json"},
        # Read-only root filesystem: every library cache in the pod's own emptyDir, not
        # a shared (writable, poisonable) place.
        {"name": "HOME", "value": HOME_DIR},
        {"name": "USER", "value": "ember"},  # getpass.getuser() without a passwd entry
        {"name": "XDG_CACHE_HOME", "value": f"{HOME_DIR}/.cache"},
        {"name": "XDG_CONFIG_HOME", "value": f"{HOME_DIR}/.config"},
        {"name": "TRITON_CACHE_DIR", "value": f"{HOME_DIR}/.cache/triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{HOME_DIR}/.cache/torchinductor"},
        {"name": "CUDA_CACHE_PATH", "value": f"{HOME_DIR}/.cache/nv"},
        *({"name": name, "value": value} for name, value in pod.tracing),
    ]


IMAGE_VLLM_EMBER = "/opt/ember/.venv-vllm/bin/ember"
"""The ``ember`` of vLLM's own virtualenv in Ember's image (the Dockerfile's ``cuda``
target): vLLM versions run there, every other replica and standby pod in ``ember`` on PATH."""


def _executable(kind: ReplicaKind) -> str:
    return IMAGE_VLLM_EMBER if kind.spec is not None and kind.spec.engine == "vllm" else "ember"


def _container(kind: ReplicaKind, pod: PodSettings) -> dict[str, Any]:
    mounts: list[dict[str, Any]] = [
        {"name": "weight-cache", "mountPath": pod.cache_dir},
        {"name": "data", "mountPath": DATA_DIR},
        # the container's own scratch space and shared memory, not the node's
        {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108
        {"name": "dshm", "mountPath": "/dev/shm"},  # noqa: S108
        {"name": "home", "mountPath": HOME_DIR},
    ]
    if kind.spec is not None:
        mounts.append({"name": "spec", "mountPath": SPEC_DIR, "readOnly": True})
    scrape, scrape_env = [], []  # the replica's own /metrics, for the scraper (no secret)
    if pod.metrics_port:
        scrape = [{"name": "metrics", "containerPort": pod.metrics_port, "protocol": "TCP"}]
        scrape_env = [{"name": "EMBER_ENGINE_METRICS_PORT", "value": str(pod.metrics_port)}]
    return {
        "name": "engine",
        "image": pod.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [_executable(kind)],
        "args": _args(kind, pod),
        "ports": [{"name": "http", "containerPort": pod.port, "protocol": "TCP"}, *scrape],
        "env": [*_env(kind, pod), *scrape_env],
        "envFrom": [{"configMapRef": {"name": pod.config_map, "optional": True}}],
        "resources": _resources(kind.placement),
        # Ready = serving hot (/readyz) for a version; alive without weights for a
        # standby pod. No liveness probe: the pools controller probes /healthz itself
        # and replaces a hung replica (a kubelet restart behind its back would not be).
        "readinessProbe": {
            "httpGet": {"path": "/healthz" if kind.spec is None else "/readyz", "port": "http"},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 2,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_S)]}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }


def _volumes(kind: ReplicaKind, pod: PodSettings) -> list[dict[str, Any]]:
    # GPU nodes have the NVMe mounted at the cache path by their launch template; type
    # Directory (not DirectoryOrCreate) so a pod on a node without it fails to start
    # instead of filling the root disk. CPU nodes have no NVMe: a scratch cache.
    cache: dict[str, Any] = (
        {"hostPath": {"path": pod.cache_dir, "type": "Directory"}}
        if kind.placement.accelerator
        else {"emptyDir": {"sizeLimit": "20Gi"}}
    )
    volumes = [
        {"name": "weight-cache", **cache},
        {"name": "data", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
        {"name": "home", "emptyDir": {"sizeLimit": "4Gi"}},
    ]
    if kind.spec is not None:  # the VersionSpec, from the pod's own annotation
        path = f"metadata.annotations['{SPEC}']"
        item = {"path": "spec.json", "fieldRef": {"fieldPath": path}}
        volumes.append({"name": "spec", "downwardAPI": {"items": [item]}})
    return volumes


def _placement(kind: ReplicaKind) -> dict[str, Any]:
    accelerator = kind.placement.accelerator
    if not accelerator:
        return {"nodeSelector": {"ember.dev/pool": "system"}}
    taint = {"key": GPU_TAINT, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
    return {
        "nodeSelector": {"ember.dev/accelerator": accelerator, "ember.dev/nvme-cache": "true"},
        "tolerations": [taint],
    }


def pod_spec(kind: ReplicaKind, pod: PodSettings) -> dict[str, Any]:
    return {
        "serviceAccountName": pod.service_account,
        # A replica never calls Kubernetes: no API token in the pod (IRSA's own projected
        # web-identity token, audience sts.amazonaws.com, is injected regardless).
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,  # service env vars would read as EMBER_* settings
        "terminationGracePeriodSeconds": pod.termination_grace_s,
        **_placement(kind),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_UID,  # the GPU launch template chowns the cache to this UID
            "runAsGroup": ENGINE_UID,
            "fsGroup": ENGINE_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(kind, pod)],
        "volumes": _volumes(kind, pod),
    }


def version_labels(kind: ReplicaKind) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "ember",
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "ember.dev/tier": kind.tier,
        "ember.dev/hardware": label_value(kind.hardware),
    }
    if kind.spec is not None:
        labels |= {
            "ember.dev/model": label_value(kind.model),
            "ember.dev/version": label_value(kind.version),
            "ember.dev/deployment": label_value(kind.deployment),
            "ember.dev/tenant": str(kind.tenant_id),
        }
    return labels


def version_annotations(kind: ReplicaKind) -> dict[str, str]:
    """Exact names (labels may be sanitised) and, for a version, the spec it serves."""
    if kind.spec is None:
        return {}
    return {
        "ember.dev/model": kind.model,
        "ember.dev/version": kind.version,
        "ember.dev/deployment": kind.deployment,
        "ember.dev/tenant-id": str(kind.tenant_id),
        SPEC: json.dumps(kind.spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":")),
    }


def scrape_annotations(pod: PodSettings) -> dict[str, str]:
    """Where an annotation-driven Prometheus scrapes the pod (deploy/k8s/monitoring has a
    PodMonitor for the Prometheus Operator)."""
    if not pod.metrics_port:
        return {}
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(pod.metrics_port),
            "prometheus.io/path": "/metrics"}  # fmt: skip


def deployment(kind: ReplicaKind, pod: PodSettings) -> dict[str, Any]:
    """The Deployment for ``kind`` (created with 0 replicas; the backend scales it)."""
    template = {
        "metadata": {
            "labels": version_labels(kind),
            "annotations": version_annotations(kind) | scrape_annotations(pod),
        },
        "spec": pod_spec(kind, pod),
    }
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
    if kind.spec is None:
        name = f"ember-standby-{_slug(kind.hardware, 30)}-{digest}"
    else:
        name = f"ember-{_slug(kind.deployment, 20)}-{_slug(kind.version, 12)}-{digest}"
    template["metadata"]["labels"] = {**version_labels(kind), GROUP: name}
    # The Secret's name derives from the Deployment's, so the reference joins the template
    # after the digest (as the GROUP label does).
    ref = {"secretKeyRef": {"name": secret_name(name), "key": SECRET_KEY}}
    template["spec"]["containers"][0]["env"].append({"name": REPLICA_SECRET_ENV, "valueFrom": ref})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": pod.namespace,
            "labels": version_labels(kind),
            "annotations": {k: v for k, v in version_annotations(kind).items() if k != SPEC},
        },
        "spec": {
            "replicas": 0,
            "revisionHistoryLimit": 1,
            "selector": {"matchLabels": {GROUP: name}},
            "template": template,
        },
    }


def assigned_labels(kind: ReplicaKind) -> dict[str, str | None]:
    """The label patch that moves an assigned standby pod out of its standby Deployment
    (its ReplicaSet releases it and starts a replacement standby pod) and names the
    version it now serves."""
    return {**version_labels(kind), GROUP: None}


def secret_name(deployment_name: str) -> str:
    """The Secret holding the replica API's secret of every pod of ``deployment_name``."""
    return f"{deployment_name}-secret"


def secret_ref(pod_spec: dict[str, Any]) -> str | None:
    """The Secret a pod (spec) reads ``EMBER_REPLICA_SECRET`` from; None for a pod started
    without one (rendered before replica secrets existed)."""
    for container in pod_spec.get("containers") or []:
        for env in container.get("env") or []:
            ref = (env.get("valueFrom") or {}).get("secretKeyRef") or {}
            if env.get("name") == REPLICA_SECRET_ENV and ref.get("name"):
                return str(ref["name"])
    return None


def replica_secret(owner: dict[str, Any], value: str) -> dict[str, Any]:
    """The Secret of Deployment ``owner`` (the object as the API returned it: its uid is
    the owner reference, so the Secret is garbage-collected with the Deployment). The pods
    of one Deployment share one pod template, so they share its secret; a standby pod
    keeps its standby Deployment's when it is assigned."""
    meta = owner["metadata"]
    ref = {"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"], "uid": meta["uid"]}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {
            "name": secret_name(meta["name"]),
            "namespace": meta.get("namespace"),
            "labels": {**(meta.get("labels") or {}), GROUP: meta["name"]},
            "ownerReferences": [ref],
        },
        "data": {SECRET_KEY: base64.b64encode(value.encode()).decode()},
    }


def secret_value(secret: dict[str, Any]) -> str:
    """The replica API's secret held by Secret ``secret`` (as the API returns it)."""
    return base64.b64decode((secret.get("data") or {})[SECRET_KEY]).decode()
