"""deploy/k8s as the pools controller needs it: rendered with kustomize (base and the aws
overlay with stand-in Terraform values), strictly valid, and passing Ember's manifest rules
(deploy/k8s/tests/check_manifests.py) — above all, the API pods' Role grants exactly the
Kubernetes rights the replica backend and the Lease election use. The fast part of
infra/check.sh's k8s step; needs ``kubectl`` (kustomize built in)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from ember.pools.backends.kubernetes import API_RIGHTS

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (kustomize) not installed")
OVERLAY_INFRA = {
    "API_ROLE_ARN": "arn:aws:iam::210987654321:role/prod-api",
    "WORKER_ROLE_ARN": "arn:aws:iam::210987654321:role/prod-worker",
    "ENGINE_ROLE_ARN": "arn:aws:iam::210987654321:role/prod-replica",
    "GPU_TYPES": "nvidia-h100,nvidia-l40s",
    "IMAGE": "210987654321.dkr.ecr.us-east-1.amazonaws.com/ember:0.2.0",
}


def _checks() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_manifests", K8S / "tests" / "check_manifests.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_manifests = _checks()


def _render(path: Path) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=120, check=True).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


def _env(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip())


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return _render(K8S / "base")


@pytest.fixture(scope="module")
def overlay(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The aws overlay with the env files render-env.sh would write, other values than the
    base's (a value the overlay fails to substitute would keep the base's)."""
    work = tmp_path_factory.mktemp("k8s")
    for part in ("base", "overlays"):
        shutil.copytree(K8S / part, work / part)
    aws = work / "overlays" / "aws"
    config = (K8S / "base" / "ember-config.env").read_text()
    (aws / "ember-config.env").write_text(config.replace("123456789012", "210987654321"))
    infra = _env(K8S / "base" / "ember-infra.env") | OVERLAY_INFRA
    (aws / "ember-infra.env").write_text("".join(f"{k}={v}\n" for k, v in infra.items()))
    (aws / "ember-secrets.env").write_text("EMBER_ADMIN_KEY=0123456789abcdef0123456789abcdef\n")
    return _render(aws)


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = check_manifests.generated({kind: {d["metadata"]["name"]: d for d in docs
                                              if d["kind"] == kind}}, kind, name)  # fmt: skip
    assert found is not None, f"no {kind} {name}"
    return dict(found)


@needs_kubectl
def test_the_base_and_the_overlay_pass_the_manifest_rules(
    base: list[dict[str, Any]], overlay: list[dict[str, Any]]
) -> None:
    assert check_manifests.check(base, overlay=False) == []
    assert check_manifests.check(overlay, overlay=True) == []


@needs_kubectl
def test_the_rendered_manifests_validate_strictly(
    base: list[dict[str, Any]], overlay: list[dict[str, Any]]
) -> None:
    import kubernetes_validate

    for doc in base + overlay:
        for version in ("1.30.0", "1.33.0"):  # infra/check.sh runs every EKS version
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_rights_the_checker_reads_are_the_backends() -> None:
    assert check_manifests.backend_rights() == set(API_RIGHTS)


@needs_kubectl
def test_the_api_role_grants_exactly_what_the_backend_uses(base: list[dict[str, Any]]) -> None:
    assert check_manifests.role_rights(base, "ember-api") == set(API_RIGHTS)
    for account in ("ember-worker", "ember-engine", "ember-beat"):
        assert check_manifests.role_rights(base, account) == set()


@needs_kubectl
def test_a_missing_or_an_extra_right_is_reported(base: list[dict[str, Any]]) -> None:
    docs = yaml.safe_load_all(yaml.safe_dump_all(base))  # a deep copy
    docs = [d for d in docs if d]
    role = _named(docs, "Role", "ember-api-pools")
    leases = next(r for r in role["rules"] if r["apiGroups"] == ["coordination.k8s.io"])
    leases["verbs"] = ["get", "create", "update"]  # patch missing, update unused
    errors = "\n".join(check_manifests.check(docs, overlay=False))
    assert "lacks the rights the backend uses: [('coordination.k8s.io', 'leases', 'patch')]" in (
        errors
    )
    assert "never uses: [('coordination.k8s.io', 'leases', 'update')]" in errors


@needs_kubectl
def test_the_api_pods_get_the_backend_settings(overlay: list[dict[str, Any]]) -> None:
    from ember.config import Settings

    api = _named(overlay, "Deployment", "ember-api")["spec"]["template"]["spec"]
    env: dict[str, str] = {}
    for source in api["containers"][0]["envFrom"]:
        if "configMapRef" in source:
            env |= _named(overlay, "ConfigMap", source["configMapRef"]["name"])["data"]
    settings = Settings.model_validate(
        {k.removeprefix("EMBER_").lower(): v for k, v in env.items()}
    )  # what `ember serve` in the pod would read (the secrets aside)
    assert settings.replica_backend == "kubernetes"
    assert settings.k8s_image == OVERLAY_INFRA["IMAGE"] == api["containers"][0]["image"]
    assert settings.k8s_standby_accelerators == ["nvidia-h100", "nvidia-l40s"]
    assert str(settings.cache_dir) == check_manifests.CACHE_DIR
    assert settings.k8s_namespace == _named(overlay, "Namespace", "ember")["metadata"]["name"]
    engine = _named(overlay, "ConfigMap", settings.k8s_config_map)
    assert engine["metadata"]["name"] == settings.k8s_config_map  # no hash suffix
    assert "210987654321" in engine["data"]["EMBER_OBJECT_STORE_URL"]  # Terraform's values
    account = _named(overlay, "ServiceAccount", settings.k8s_service_account)
    assert (
        account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
        == (OVERLAY_INFRA["ENGINE_ROLE_ARN"])
    )


@needs_kubectl
def test_a_base_value_left_in_the_overlay_is_reported(overlay: list[dict[str, Any]]) -> None:
    docs = [d for d in yaml.safe_load_all(yaml.safe_dump_all(overlay)) if d]
    account = _named(docs, "ServiceAccount", "ember-worker")
    account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] = (
        "arn:aws:iam::123456789012:role/ember-worker"
    )
    pools = _named(docs, "ConfigMap", "ember-pools")
    pools["data"]["EMBER_K8S_IMAGE"] = "ember:0.1.0"
    errors = "\n".join(check_manifests.check(docs, overlay=True))
    assert "ServiceAccount ember-worker: role ARN" in errors
    assert "EMBER_K8S_IMAGE ember:0.1.0 is not the API's image" in errors


def test_no_manifest_names_the_removed_controller() -> None:
    for path in [*K8S.rglob("*.yaml"), *K8S.rglob("*.env"), *K8S.rglob("*.sh")]:
        text = path.read_text()
        assert "ember-controller" not in text and "CONTROLLER_ROLE_ARN" not in text, path
        assert "kind: PodTemplate" not in text, path
