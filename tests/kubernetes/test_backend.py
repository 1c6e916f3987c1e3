"""The Kubernetes backend against kmock and the fake cluster loop (see conftest)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import kmock

from ember.pools.backends import k8s_manifests as m
from ember.pools.backends.base import LaunchOptions
from ember.pools.backends.kubernetes import UNPLACED, VANISHED, KubernetesBackend
from ember.registry.schemas import Placement
from tests.kubernetes.conftest import FakeCluster, wait_for

SPEC: dict[str, Any] = {
    "model": "minilm",
    "version": "2+cpu",
    "artifact_uri": "s3://bucket/minilm/2/model.safetensors",
    "sha256": "0" * 64,
    "engine": "transformers",
}
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
    assert httpx.get(f"{url}/info").json()["state"] == "ready"
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
    assert env["OMP_NUM_THREADS"] == "3" and env["EMBER_CACHE_DIR"] == "/mnt/nvme/ember-cache"
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
    assert httpx.get(f"{second.url}/info").status_code == 200
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
    assert httpx.get(f"{standby.url}/info").json()["state"] == "standby"
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
