"""The replica pods are scrapable (issue 23 §3): the backend renders a ``metrics`` port,
the setting that makes the replica serve it and ``prometheus.io/*`` annotations;
deploy/k8s/monitoring's PodMonitor selects those pods on that port and its NetworkPolicy
opens that port, and only that port, to the monitoring namespace's Prometheus."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ember.config import Settings
from ember.pools.backends import k8s_manifests as m
from ember.registry.schemas import Placement
from tests.kubernetes.test_backend import SPEC

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "monitoring"
KUBECTL = shutil.which("kubectl")
POD = m.PodSettings("ember", "ember:0.1.0", "ember-engine", "ember-config", 9000,
                    "/mnt/nvme/ember-cache", 60, metrics_port=9090)  # fmt: skip
KINDS = [
    m.ReplicaKind(1, "search", "minilm", "2", SPEC, Placement(), (32, 5.0, 1024)),
    m.ReplicaKind(0, "", "", "", None, Placement(), (32, 5.0, 1024)),
]


def _template(kind: m.ReplicaKind, pod: m.PodSettings = POD) -> dict[str, Any]:
    template: dict[str, Any] = m.deployment(kind, pod)["spec"]["template"]
    return template


def _monitoring() -> dict[str, dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl (kustomize) not installed")
    out = subprocess.run([KUBECTL, "kustomize", str(MONITORING)], capture_output=True,
                         text=True, timeout=120, check=True).stdout  # fmt: skip
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(out) if d}


def test_every_replica_pod_has_a_metrics_port_and_scrape_annotations() -> None:
    assert Settings().k8s_replica_metrics_port == POD.metrics_port
    for kind in KINDS:
        template = _template(kind)
        container = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"http": 9000, "metrics": 9090}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["EMBER_ENGINE_METRICS_PORT"] == "9090"
        notes = template["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert notes["prometheus.io/port"] == "9090"
        assert notes["prometheus.io/path"] == "/metrics"
    # unset: no port, no setting, no annotation
    bare = _template(KINDS[0], dataclasses.replace(POD, metrics_port=None))
    container = bare["spec"]["containers"][0]
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert "EMBER_ENGINE_METRICS_PORT" not in {e["name"] for e in container["env"]}
    assert not any(k.startswith("prometheus.io/") for k in bare["metadata"]["annotations"])


def test_the_rendered_pods_with_a_metrics_port_validate_strictly(tmp_path: Path) -> None:
    files = []
    for i, kind in enumerate(KINDS):
        path = tmp_path / f"{i}.yaml"
        path.write_text(yaml.safe_dump(m.deployment(kind, POD)))
        files.append(str(path))
    policy = _monitoring()["NetworkPolicy/ember-engine-metrics-ingress"]
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    files.append(str(tmp_path / "policy.yaml"))
    exe = Path(sys.executable).with_name("kubernetes-validate")
    result = subprocess.run([str(exe), "--strict", "--quiet", "-k", "1.31.0", *files],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert not selector.get("matchExpressions")
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def test_the_podmonitor_and_the_policy_select_the_rendered_pods_on_the_metrics_port() -> None:
    docs = _monitoring()
    replicas = docs["PodMonitor/ember-replicas"]["spec"]
    policy = docs["NetworkPolicy/ember-engine-metrics-ingress"]["spec"]
    for kind in KINDS:
        labels = _template(kind)["metadata"]["labels"]
        assert _selects(replicas["selector"], labels)
        assert _selects(policy["podSelector"], labels)
    endpoint = replicas["podMetricsEndpoints"][0]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert targets["deployment"] == ["__meta_kubernetes_pod_label_ember_dev_deployment"]
    assert targets["tenant_id"] == ["__meta_kubernetes_pod_label_ember_dev_tenant"]
    # the policy opens the metrics port alone, to the monitoring namespace's Prometheus
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": 9090, "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    # the API's scrape: its named port, with a bearer token from a Secret
    api = docs["PodMonitor/ember-api"]["spec"]
    assert api["selector"]["matchLabels"] == {"app.kubernetes.io/component": "api"}
    assert api["podMetricsEndpoints"][0]["port"] == "http"
    assert api["podMetricsEndpoints"][0]["authorization"]["type"] == "Bearer"
