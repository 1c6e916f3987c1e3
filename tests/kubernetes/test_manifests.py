"""Every object the backend renders passes ``kubernetes-validate --strict`` for each
Kubernetes version EKS supports (standard and extended support: 1.29 to 1.33)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import kmock
import pytest
import yaml

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


def _rendered() -> list[dict[str, Any]]:
    docs = [m.deployment(kind, POD) for kind in KINDS.values()]
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
