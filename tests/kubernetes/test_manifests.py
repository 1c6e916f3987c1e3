"""Every object the backend renders passes ``kubernetes-validate --strict`` for each
Kubernetes version EKS supports (standard and extended support: 1.29 to 1.33); every
replica pod runs with least privilege, and deploy/k8s's NetworkPolicies fence it in."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import kmock
import pytest
import yaml

from ember.domain.spec import REPLICA_SECRET_ENV
from ember.pools.backends import k8s_manifests as m
from ember.pools.backends.base import LaunchOptions
from ember.pools.backends.kubernetes import API_RIGHTS, KubernetesBackend
from ember.pools.leader import LeaseElection
from ember.registry.schemas import Placement
from tests.kubernetes.conftest import NAMESPACE, FakeCluster, api_client, wait_for
from tests.kubernetes.test_backend import SPEC

EKS_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0"]
POD = m.PodSettings(NAMESPACE, "123.dkr.ecr.us-east-1.amazonaws.com/ember:0.1.0",
                    "ember-engine", "ember-config", 9000, "/mnt/nvme/ember-cache", 60)  # fmt: skip
GPU = Placement(accelerator="nvidia-l40s", gpus=1, cpu_cores=3, memory_gib=24, threads=2)
KINDS = {
    "version-gpu": m.ReplicaKind(1, "search", "minilm", "2+cpu", SPEC, GPU, (16, 2.5, 512)),
    "version-cpu": m.ReplicaKind(1, "search", "minilm", "2", SPEC, Placement(), (32, 5.0, 1024)),
    "standby-gpu": m.ReplicaKind(0, "", "", "", None, GPU, (32, 5.0, 1024)),
    "standby-cpu": m.ReplicaKind(0, "", "", "", None, Placement(), (32, 5.0, 1024)),
}


K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
WRITABLE = {"tmp", "dshm", "home", "data", "weight-cache"}
"""The replica's writable volumes (the root filesystem is read-only)."""


def _rendered() -> list[dict[str, Any]]:
    docs = [m.deployment(kind, POD) for kind in KINDS.values()]
    owner = {"metadata": {**docs[0]["metadata"], "uid": "0b6f6c1e-4c8a-4d53-9d2e-1f0a7e3c9b21"}}
    docs.append(m.replica_secret(owner, "not-a-real-secret"))
    lease = LeaseElection(api_client("http://127.0.0.1:1"), NAMESPACE, "ember-pools")
    docs.append(lease.manifest(transitions=3))
    lease.api.api_client.close()
    return docs


def test_rendered_manifests_validate_strictly_on_every_eks_version(tmp_path: Path) -> None:
    files = []
    for i, doc in enumerate(_rendered()):
        path = tmp_path / f"{i}-{doc['kind'].lower()}.yaml"
        path.write_text(yaml.safe_dump(doc))
        files.append(str(path))
    exe = Path(sys.executable).with_name("kubernetes-validate")
    for version in EKS_VERSIONS:
        result = subprocess.run([str(exe), "--strict", "--quiet", "-k", version, *files],
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert result.returncode == 0, f"{version}: {result.stdout}{result.stderr}"


def test_an_unknown_field_fails_validation(tmp_path: Path) -> None:
    # The check above would catch a typo: prove it on one.
    doc = m.deployment(KINDS["version-cpu"], POD)
    doc["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    exe = Path(sys.executable).with_name("kubernetes-validate")
    result = subprocess.run([str(exe), "--strict", "-k", "1.31.0", str(path)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode != 0 and "resource" in result.stdout + result.stderr


def test_what_the_backend_sent_validates(
    make_backend: Callable[..., KubernetesBackend],
    cluster: FakeCluster,
    kube: tuple[str, kmock.KubernetesEmulator],
) -> None:
    import kubernetes_validate

    backend = make_backend(k8s_standby_accelerators="nvidia-l40s,cpu")
    backend.launch(SPEC, LaunchOptions(placement=GPU, deployment="search"))
    backend.launch(None, LaunchOptions())
    backend.launch(None, LaunchOptions())
    sent = wait_for(lambda: len(cluster.deployments()) == 3 and cluster.deployments(), "3 sent")
    for doc in sent.values():
        doc.setdefault("apiVersion", "apps/v1")
        doc.setdefault("kind", "Deployment")
        for version in EKS_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def _right(method: str, url: str, query: Any) -> tuple[str, str, str]:
    """The RBAC (API group, resource, verb) a request needs, as the API server derives it."""
    parsed = urlsplit(url)
    params = dict(parse_qsl(parsed.query)) | {k: str(v) for k, v in (query or [])}
    parts = parsed.path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource, named = "/".join(rest[:1] + rest[2:3]), len(rest) > 1
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method)
    if method == "GET":
        verb = (
            "get" if named else ("watch" if params.get("watch", "").lower() == "true" else "list")
        )
    elif method == "DELETE":
        verb = "delete" if named else "deletecollection"
    assert verb is not None, method
    return group, resource, verb


def test_the_backend_and_the_election_use_only_the_rights_they_declare(
    make_backend: Callable[..., KubernetesBackend],
    cluster: FakeCluster,
    kube: tuple[str, kmock.KubernetesEmulator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every request of a launch / scale / standby assignment / stop / kill / adoption and
    of a Lease take-over, renewal and release is recorded (the fake cluster's own aside):
    API_RIGHTS, which deploy/k8s grants the API pods (tests/infra/test_manifests.py), must
    cover them all, and lists nothing they never use."""
    from kubernetes.client import rest

    used: set[tuple[str, str, str]] = set()
    original = rest.RESTClientObject.request

    def request(self: Any, method: str, url: str, query_params: Any = None,
                *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        if self is not cluster.api.rest_client:
            used.add(_right(method, url, query_params))
        return original(self, method, url, query_params, *args, **kwargs)

    monkeypatch.setattr(rest.RESTClientObject, "request", request)
    cpu = LaunchOptions(placement=Placement(), deployment="search")
    backend = make_backend(k8s_standby_accelerators="cpu")
    served, spare = backend.launch(SPEC, cpu), backend.launch(SPEC, cpu)
    standby = backend.launch(None, LaunchOptions())
    wait_for(lambda: served.url and spare.url and standby.url, "three pods running")
    backend.assigned(standby, SPEC, cpu)
    backend.stop(served, grace_s=5)
    backend.kill(spare)
    successor = make_backend(k8s_standby_accelerators="cpu")
    assert successor.adopt()  # the assigned pod
    wait_for(lambda: ("", "pods", "watch") in used, "the pod watch")

    clock = [100.0]
    a, b = (LeaseElection(api_client(kube[0]), NAMESPACE, "ember-pools", identity=who,
                          clock=lambda: clock[0]) for who in ("a", "b"))  # fmt: skip
    assert a.step() and a.step() and not b.step()  # create, renew; b reads
    a.release()
    assert b.step()  # takes over
    a.api.api_client.close()
    b.api.api_client.close()

    assert used == set(API_RIGHTS)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_replica_pod_runs_with_least_privilege(name: str) -> None:
    """Non-root with fixed ids, read-only root filesystem (every cache a library writes in a
    writable emptyDir), no capabilities or escalation, RuntimeDefault seccomp, no
    service-account token; the secret by reference only; probes need no secret."""
    doc = m.deployment(KINDS[name], POD)
    spec = doc["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": m.ENGINE_UID, "runAsGroup": m.ENGINE_UID,
        "fsGroup": m.ENGINE_UID, "seccompProfile": {"type": "RuntimeDefault"},
    }  # fmt: skip
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    (container,) = spec["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }  # fmt: skip
    volumes = {v["name"]: v for v in spec["volumes"]}
    host_paths = [v["hostPath"]["path"] for v in volumes.values() if "hostPath" in v]
    assert host_paths == ([POD.cache_dir] if KINDS[name].placement.accelerator else [])
    mounts = {mnt["mountPath"]: mnt for mnt in container["volumeMounts"]}
    writable = [path for path, mnt in mounts.items()
                if mnt["name"] in WRITABLE and not mnt.get("readOnly")]  # fmt: skip
    assert all(mnt["name"] in WRITABLE or mnt.get("readOnly") for mnt in mounts.values())
    env = {e["name"]: e for e in container["env"]}
    for var in ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "TRITON_CACHE_DIR",
                "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "EMBER_DATA_DIR",
                "EMBER_CACHE_DIR"):  # fmt: skip
        path = env[var]["value"]
        assert any(path == w or path.startswith(w + "/") for w in writable), (var, path)
    assert env[REPLICA_SECRET_ENV] == {"name": REPLICA_SECRET_ENV, "valueFrom": {"secretKeyRef": {
        "name": m.secret_name(doc["metadata"]["name"]), "key": m.SECRET_KEY}}}  # fmt: skip
    assert container["readinessProbe"]["httpGet"]["path"] in ("/healthz", "/readyz")
    assert "livenessProbe" not in container


def _checks() -> Any:
    spec = importlib.util.spec_from_file_location("check_manifests", K8S / "tests" /
                                                  "check_manifests.py")  # fmt: skip
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl (kustomize) not installed")
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / "base")], capture_output=True,
                         text=True, timeout=120, check=True).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


def test_the_network_policies_select_the_rendered_replica_pods_and_fence_them(
    base: list[dict[str, Any]],
) -> None:
    """deploy/k8s's NetworkPolicies select the pods the backend renders (their labels, not
    check_manifests' copy of them) for ingress and egress, and pass its rules: in from the
    API and worker pods on the replica port only, out to DNS and public HTTPS only."""
    checks = _checks()
    policies = [d for d in base if d["kind"] == "NetworkPolicy"]
    for kind in KINDS.values():
        labels = m.deployment(kind, POD)["spec"]["template"]["metadata"]["labels"]
        assert all(labels[k] == v for k, v in checks.ENGINE_LABELS.items())
        chosen = [p for p in policies if checks.selects(p, labels)]
        types = {t for p in chosen for t in p["spec"]["policyTypes"]}
        assert types == {"Ingress", "Egress"}, [p["metadata"]["name"] for p in chosen]
    by_kind = {"NetworkPolicy": {p["metadata"]["name"]: p for p in policies}}
    assert checks.check_engine_network(by_kind, str(POD.port)) == []


def test_a_wider_replica_network_policy_is_reported(base: list[dict[str, Any]]) -> None:
    checks = _checks()
    policies = {d["metadata"]["name"]: d for d in yaml.safe_load_all(yaml.safe_dump_all(base))
                if d and d["kind"] == "NetworkPolicy"}  # fmt: skip
    egress = policies["ember-engine-egress"]["spec"]["egress"]
    egress[1]["to"][0]["ipBlock"]["except"].remove("10.0.0.0/8")  # the VPC: Redis, the API
    egress.append({"ports": [{"port": 6379, "protocol": "TCP"}]})  # anywhere on 6379
    ingress = policies["ember-engine-ingress"]["spec"]["ingress"][0]
    ingress["from"].append({"namespaceSelector": {}})  # any pod of any namespace
    errors = "\n".join(checks.check_engine_network({"NetworkPolicy": policies}, "9000"))
    assert errors.count("is neither DNS") == 2 and "replica ingress from" in errors
    del policies["ember-engine-egress"]
    errors = "\n".join(checks.check_engine_network({"NetworkPolicy": policies}, "9000"))
    assert "no NetworkPolicy restricts egress of the replica pods" in errors


@pytest.mark.parametrize(
    "placement",
    [Placement(accelerator="nvidia-l40s", gpus=n) for n in (0, 1, 4)] + [Placement(gpus=2)],
)
def test_a_pod_asks_for_the_gpus_the_local_backend_would_give(placement: Placement) -> None:
    # One reading of a placement on both backends: ``gpus`` devices where it names an
    # accelerator (nvidia.com/gpu here, CUDA_VISIBLE_DEVICES there), and --device cuda.
    from ember.pools.backends.local import gpus_asked

    kind = m.ReplicaKind(1, "search", "minilm", "2", SPEC, placement, (32, 5.0, 1024))
    container = m.deployment(kind, POD)["spec"]["template"]["spec"]["containers"][0]
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    want = gpus_asked(placement)
    assert limits.get(m.GPU_TAINT, 0) == requests.get(m.GPU_TAINT, 0) == want
    assert ("--device" in container["args"]) == (want > 0)
    if want:
        assert container["args"][container["args"].index("--device") + 1] == "cuda"


def test_vllm_versions_run_in_the_images_vllm_environment() -> None:
    """The image keeps vLLM in a virtualenv of its own (the Dockerfile's cuda target):
    a vLLM version's pod runs that ``ember``, every other pod the one on PATH, and a
    standby pod (the generic runtime, no vLLM) never takes a vLLM version."""
    placement = Placement(accelerator="nvidia-l40s", gpus=1)
    for engine, exe in (("vllm", m.IMAGE_VLLM_EMBER), ("torch", "ember")):
        spec = SPEC.model_copy(update={"engine": engine})
        kind = m.ReplicaKind(1, "chat", "llm", "1", spec, placement, (8, 5.0, 64))
        container = m.deployment(kind, POD)["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == [exe]
    standby = m.ReplicaKind(0, "", "", "", None, placement, (8, 5.0, 64))
    assert m.deployment(standby, POD)["spec"]["template"]["spec"]["containers"][0][
        "command"] == ["ember"]  # fmt: skip
    dockerfile = (Path(__file__).parents[2] / "Dockerfile").read_text()
    assert m.IMAGE_VLLM_EMBER.removesuffix("/bin/ember") in dockerfile
    backend = KubernetesBackend.__new__(KubernetesBackend)
    assert not backend.standby_can_run(SPEC.model_copy(update={"engine": "vllm"}))
    assert backend.standby_can_run(SPEC.model_copy(update={"engine": "torch"}))
