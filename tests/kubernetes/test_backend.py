"""The Kubernetes backend against kmock and the fake cluster loop (see conftest)."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import kmock
import pytest

from ember.domain.spec import REPLICA_SECRET_ENV, REPLICA_SECRET_HEADER, VersionSpec
from ember.logs import configure_logging
from ember.pools.backends import k8s_manifests as m
from ember.pools.backends.base import LaunchOptions
from ember.pools.backends.kubernetes import UNPLACED, VANISHED, KubernetesBackend
from ember.registry.schemas import Placement
from tests.kubernetes.conftest import NAMESPACE, FakeCluster, wait_for

SPEC = VersionSpec(
    model="minilm",
    version="2+cpu",
    artifact_uri="s3://bucket/minilm/2/model.safetensors",
    sha256="0" * 64,
    engine="transformers",
)
GPU = Placement(accelerator="nvidia-l40s", gpus=1, cpu_cores=3, memory_gib=24)
OPTIONS = LaunchOptions(16, 2.0, tenant_id=1, deployment="search", placement=GPU)
Make = Callable[..., KubernetesBackend]


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = obj["metadata"].get("labels") or {}
    return labels


def _pod_of(cluster: FakeCluster, name: str) -> dict[str, Any] | None:
    return next((p for p in cluster.pods() if p["metadata"]["name"] == name), None)


def test_launch_creates_a_labelled_deployment_and_the_pod_answers(
    make_backend: Make, cluster: FakeCluster
) -> None:
    backend = make_backend()
    handle = backend.launch(SPEC, OPTIONS)
    assert handle.url == ""  # returns at once; the pod comes later
    url = wait_for(lambda: handle.url, "the pod's URL")
    assert httpx.get(f"{url}/info", headers=handle.auth).json()["state"] == "ready"
    assert url.startswith("http://127.0.0.") and backend.exited(handle) is None

    (deployment,) = cluster.deployments().values()
    labels = _labels(deployment)
    assert labels["ember.dev/model"] == "minilm" and labels["ember.dev/version"] == "2_cpu"
    assert labels["ember.dev/tier"] == "hot" and labels["ember.dev/hardware"] == "nvidia-l40s"
    assert deployment["metadata"]["annotations"]["ember.dev/version"] == "2+cpu"
    assert deployment["spec"]["replicas"] == 1
    pod_spec = deployment["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"]["ember.dev/accelerator"] == "nvidia-l40s"
    assert pod_spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    container = pod_spec["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OMP_NUM_THREADS"] == "3" and env["EMBER_CACHE_DIR"] == "/mnt/nvme/ember-cache/t1"
    assert container["resources"]["limits"] == {"cpu": "3000m", "memory": "24576Mi",
                                                "nvidia.com/gpu": 1}  # fmt: skip
    cache = next(v for v in pod_spec["volumes"] if v["name"] == "weight-cache")
    assert cache["hostPath"] == {"path": "/mnt/nvme/ember-cache", "type": "Directory"}
    pod = wait_for(lambda: _pod_of(cluster, handle.extra["pod"]), "the pod")
    assert (
        pod["metadata"]["annotations"].get(m.REPLICA_ID)
        or wait_for(
            lambda: (_pod_of(cluster, handle.extra["pod"]) or {})["metadata"]["annotations"].get(
                m.REPLICA_ID
            ),
            "the replica id annotation",
        )
        == handle.replica_id
    )


def test_scale_up_then_stop_one_drains_and_deletes_that_pod(
    make_backend: Make, cluster: FakeCluster
) -> None:
    backend = make_backend()
    first, second = backend.launch(SPEC, OPTIONS), backend.launch(SPEC, OPTIONS)
    wait_for(lambda: first.url and second.url, "both pods running")
    (name,) = cluster.deployments()
    assert cluster.deployments()[name]["spec"]["replicas"] == 2  # one coalesced patch or two
    gone = first.extra["pod"]
    backend.stop(first, grace_s=5)
    left = _pod_of(cluster, gone)  # stop() returns once the deletion is accepted
    assert left is None or left["metadata"].get("deletionTimestamp")
    wait_for(lambda: _pod_of(cluster, gone) is None, "the kubelet to finish the pod")
    assert cluster.deployments()[name]["spec"]["replicas"] == 1
    assert backend.exited(first) == VANISHED  # no longer ours
    assert backend.exited(second) is None
    assert httpx.get(f"{second.url}/info", headers=second.auth).status_code == 200
    remaining = [p["metadata"]["name"] for p in cluster.pods()]
    assert remaining == [second.extra["pod"]]


def test_the_watch_sees_new_and_vanished_pods_within_seconds(
    make_backend: Make, cluster: FakeCluster
) -> None:
    backend = make_backend()
    handle = backend.launch(SPEC, OPTIONS)
    wait_for(lambda: handle.url, "the new pod", timeout_s=3)
    lost = time.monotonic()
    cluster.lose_node_of(handle.extra["pod"])
    wait_for(lambda: backend.exited(handle) is not None, "the lost pod seen", timeout_s=3)
    assert time.monotonic() - lost < 3
    assert backend.exited(handle) == VANISHED
    assert "vanished" in (backend.exit_reason(handle) or "")
    # The controller kills and replaces it: the Deployment gets a new pod.
    backend.kill(handle)
    replacement = backend.launch(SPEC, OPTIONS)
    wait_for(lambda: replacement.url, "the replacement pod", timeout_s=3)
    assert replacement.extra["pod"] != handle.extra["pod"]


def test_a_pod_stuck_pending_is_reported_with_its_reason_and_counted(
    make_backend: Make, cluster: FakeCluster
) -> None:
    cluster.unschedulable.add("nvidia-l40s")
    # long enough for the fake kubelet to mark the pod unschedulable on a loaded machine
    backend = make_backend(k8s_pending_timeout_s=3.0)
    handle = backend.launch(SPEC, OPTIONS)
    wait_for(lambda: backend.exited(handle) is not None, "the pending pod reported")
    assert backend.exited(handle) == UNPLACED
    reason = backend.exit_reason(handle) or ""
    assert "Unschedulable" in reason and "Insufficient nvidia.com/gpu" in reason
    counted = backend.unplaced.labels(hardware="nvidia-l40s", reason="Unschedulable")
    assert counted._value.get() == 1
    backend.kill(handle)
    (deployment,) = cluster.deployments().values()
    wait_for(lambda: not cluster.pods(), "the pending pod removed")
    assert cluster.deployments()[deployment["metadata"]["name"]]["spec"]["replicas"] == 0


def test_api_errors_and_conflicts_are_retried_with_backoff(
    make_backend: Make, cluster: FakeCluster, kube: tuple[str, kmock.KubernetesEmulator]
) -> None:
    handler = kube[1]
    handler["patch"][:3] << 409 << {"kind": "Status", "code": 409, "reason": "Conflict"}
    handler["post"][:1] << 503 << {"kind": "Status", "code": 503, "reason": "ServiceUnavailable"}
    backend = make_backend()
    handle = backend.launch(SPEC, OPTIONS)
    wait_for(lambda: handle.url, "the pod despite the errors")
    assert backend.api_retries.labels(status="409")._value.get() >= 1
    assert backend.api_retries.labels(status="503")._value.get() == 1


def test_a_standby_pod_is_assigned_and_the_standby_pool_refills(
    make_backend: Make, cluster: FakeCluster
) -> None:
    backend = make_backend(k8s_standby_accelerators="nvidia-l40s")
    standby = backend.launch(None, LaunchOptions())
    wait_for(lambda: standby.url, "the standby pod")
    assert httpx.get(f"{standby.url}/info", headers=standby.auth).json()["state"] == "standby"
    assert backend.standby_can_take(standby, SPEC, OPTIONS)
    too_big = LaunchOptions(placement=GPU.model_copy(update={"memory_gib": 64}))
    assert not backend.standby_can_take(standby, SPEC, too_big)
    cpu = LaunchOptions(placement=Placement())
    assert not backend.standby_can_take(standby, SPEC, cpu)

    backend.assigned(standby, SPEC, OPTIONS)
    refill = backend.launch(None, LaunchOptions())  # the controller's standby top-up
    pod = standby.extra["pod"]
    wait_for(lambda: _labels(_pod_of(cluster, pod) or {"metadata": {}}).get("ember.dev/model"),
             "the assigned pod relabelled")  # fmt: skip
    labels = _labels(_pod_of(cluster, pod) or {})
    assert m.GROUP not in labels and labels["ember.dev/version"] == "2_cpu"
    wait_for(lambda: refill.url, "a new standby pod")
    assert refill.extra["pod"] != pod
    assert backend.exited(standby) is None  # the assigned pod keeps running
    (deployment,) = cluster.deployments().values()
    assert deployment["spec"]["replicas"] == 1
    backend.stop(standby, grace_s=5)
    wait_for(lambda: _pod_of(cluster, pod) is None, "the assigned pod deleted")


def _env_of(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"] if obj["kind"] == "Deployment" else obj["spec"]
    return {e["name"]: e for e in spec["containers"][0]["env"]}


def test_the_replica_secret_is_in_an_owned_secret_never_in_a_spec_or_a_log(
    make_backend: Make, cluster: FakeCluster
) -> None:
    """The backend makes the secret, keeps it in a Secret owned by the Deployment, gives
    it to the pod by ``secretKeyRef``, and the replica requires it; no object and no log
    line (DEBUG, the client's own response bodies included) holds the value."""
    stream = io.StringIO()
    configure_logging("DEBUG", "json", stream)
    try:
        backend = make_backend()
        handle = backend.launch(SPEC, OPTIONS)
        assert len(handle.secret) >= 32 and handle.secret not in repr(handle)
        url = wait_for(lambda: handle.url, "the pod's URL")
        assert httpx.get(f"{url}/info").status_code == 401  # the fake replica checks it
        wrong = {REPLICA_SECRET_HEADER: handle.secret[:-1] + "x"}
        assert httpx.get(f"{url}/info", headers=wrong).status_code == 401
        assert httpx.get(f"{url}/info", headers=handle.auth).status_code == 200
        assert httpx.get(f"{url}/healthz").status_code == 200  # the kubelet's probes: none
        assert httpx.get(f"{url}/readyz").status_code == 200

        (deployment,) = cluster.deployments().values()
        name = deployment["metadata"]["name"]
        ref = {"secretKeyRef": {"name": f"{name}-secret", "key": m.SECRET_KEY}}
        assert _env_of(deployment)[REPLICA_SECRET_ENV] == {"name": REPLICA_SECRET_ENV,
                                                           "valueFrom": ref}  # fmt: skip
        secret = cluster.secrets()[f"{name}-secret"]
        owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name,
                 "uid": deployment["metadata"]["uid"]}  # fmt: skip
        assert secret["metadata"]["ownerReferences"] == [owner]  # collected with it
        assert secret["immutable"] is True and secret["type"] == "Opaque"
        encoded = secret["data"][m.SECRET_KEY]
        assert base64.b64decode(encoded).decode() == handle.secret
        pod = _pod_of(cluster, handle.extra["pod"])
        for obj in (deployment, pod):
            text = json.dumps(obj)
            assert handle.secret not in text and encoded not in text

        successor = make_backend()  # a new leader reads it back (the read path logs too)
        adopted = successor.adopt()
        assert [o.handle.secret for o in adopted] == [handle.secret]
        assert httpx.get(f"{url}/info", headers=adopted[0].handle.auth).status_code == 200
    finally:
        configure_logging("INFO", "console")
    logged = stream.getvalue()
    assert "replica pod requested" in logged and "response body" in logged  # it did capture
    assert handle.secret not in logged and encoded not in logged


def test_no_pod_starts_before_its_secret_exists(
    make_backend: Make,
    cluster: FakeCluster,
    kube: tuple[str, kmock.KubernetesEmulator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Deployment is created with 0 replicas, then its Secret, and only then scaled up
    (a pod without its Secret would wait in CreateContainerConfigError: failed at once) —
    even when the Secret's creation fails and is retried."""
    from kubernetes.client import rest

    sent: list[tuple[str, str]] = []
    original = rest.RESTClientObject.request

    def request(self: Any, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        if self is not cluster.api.rest_client and method in ("POST", "PATCH"):
            sent.append((method, url.split("/namespaces/")[1].split("?")[0]))
        return original(self, method, url, *args, **kwargs)

    monkeypatch.setattr(rest.RESTClientObject, "request", request)
    unavailable = {"kind": "Status", "code": 503, "reason": "ServiceUnavailable"}
    kube[1]["post", f"/api/v1/namespaces/{NAMESPACE}/secrets"][:1] << 503 << unavailable
    backend = make_backend()
    handle = backend.launch(SPEC, OPTIONS)
    wait_for(lambda: handle.url, "the pod")
    assert backend.api_retries.labels(status="503")._value.get() == 1
    group = handle.extra["deployment"]
    scaled = sent.index(("PATCH", f"{NAMESPACE}/deployments/{group}"))
    assert sent[:scaled] == [
        ("POST", f"{NAMESPACE}/deployments"),
        ("POST", f"{NAMESPACE}/secrets"),  # 503
        ("POST", f"{NAMESPACE}/deployments"),  # the retry: 409, it exists
        ("POST", f"{NAMESPACE}/secrets"),  # 409 here (kmock kept it): read back
    ]
    assert cluster.config_errors == []  # no pod ever waited for a missing Secret
    assert backend.exited(handle) is None
    assert httpx.get(f"{handle.url}/info", headers=handle.auth).status_code == 200


def test_a_new_leader_gives_a_deployment_without_its_secret_one(
    make_backend: Make, cluster: FakeCluster
) -> None:
    """The previous leader created a Deployment and stopped before its Secret: no pod of
    it can start; the successor makes the Secret, and launches into the Deployment."""
    kind = m.ReplicaKind(1, "search", "minilm", "2+cpu", SPEC, GPU, (16, 2.0, 1024))
    first = make_backend()
    manifest = m.deployment(kind, first.pod)
    cluster.apps.create_namespaced_deployment(NAMESPACE, manifest)
    successor = make_backend()
    assert successor.adopt() == []
    name = manifest["metadata"]["name"]
    secret = wait_for(lambda: cluster.secrets().get(m.secret_name(name)), "the Secret")
    assert secret["metadata"]["ownerReferences"][0]["name"] == name
    handle = successor.launch(SPEC, OPTIONS)
    assert handle.extra["deployment"] == name  # the same Deployment, not a new one
    assert base64.b64decode(secret["data"][m.SECRET_KEY]).decode() == handle.secret
    wait_for(lambda: handle.url, "the pod")
    assert httpx.get(f"{handle.url}/info", headers=handle.auth).status_code == 200


def test_a_follower_reads_the_secret_back_before_it_reports_a_pod_ready(
    make_backend: Make, cluster: FakeCluster
) -> None:
    leader, follower = make_backend(), make_backend()
    handle = leader.launch(SPEC, OPTIONS)
    wait_for(lambda: handle.url, "the pod")
    observed = wait_for(lambda: [o for o in follower.observe() if o.ready], "ready on the follower")
    assert [o.handle.secret for o in observed] == [handle.secret]
    assert httpx.get(f"{handle.url}/info", headers=observed[0].handle.auth).status_code == 200
