"""Ember-specific rules on rendered manifests, beyond schema validation.

usage: python check_manifests.py RENDERED.yaml [--overlay]
Exits 1 listing every violation. Run by infra/check.sh after kubernetes-validate, and by
tests/infra/test_manifests.py.

The replicas themselves are not here: the pools controller in the API pods renders their
Deployments (ember/pools/backends/k8s_manifests.py; tests/kubernetes validates those). What
is checked here is what the API pods need for it: the backend's settings, the Role that
grants ember.pools.backends.kubernetes.API_RIGHTS, and the names the settings refer to;
and what fences the replica pods in: the NetworkPolicies that select them (ingress from
the API and worker pods on the replica port only; egress to DNS and public HTTPS only)
and their service account (no token).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import yaml

BACKEND = Path(__file__).resolve().parents[3] / "ember" / "pools" / "backends" / "kubernetes.py"

CACHE_DIR = "/mnt/nvme/ember-cache"
PROCESSES = {"api": "serve", "worker": "worker", "beat": "beat"}
"""Every Ember process kind with its Deployment; the pools controller runs in `ember serve`."""
ROLES = {"ember-api": "API_ROLE_ARN", "ember-worker": "WORKER_ROLE_ARN",
         "ember-engine": "ENGINE_ROLE_ARN"}  # fmt: skip
"""Service accounts with an IRSA role, and the ember-infra key of its ARN."""
POOLS = {"EMBER_REPLICA_BACKEND", "EMBER_K8S_IMAGE", "EMBER_K8S_NAMESPACE",
         "EMBER_K8S_SERVICE_ACCOUNT", "EMBER_K8S_CONFIG_MAP", "EMBER_K8S_STANDBY_ACCELERATORS",
         "EMBER_STANDBY_REPLICAS"}  # fmt: skip
"""Settings of the pools controller's Kubernetes backend the API pods must be given."""
ENGINE_LABELS = {"app.kubernetes.io/name": "ember", "app.kubernetes.io/component": "engine",
                 "app.kubernetes.io/managed-by": "ember-pools"}  # fmt: skip
"""Labels every replica pod carries (k8s_manifests.version_labels; tests/kubernetes checks
that the rendered pods do)."""
CALLERS = {"api", "worker"}
"""The components whose pods call replicas (the router and controller; the gateway and
the batch direct lane)."""
PRIVATE = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16"]
"""What a replica's HTTPS egress must exclude: the VPC (the Kubernetes API endpoint,
Redis, PostgreSQL, every pod), carrier-grade NAT and link-local (instance metadata)."""
DEFAULT_REPLICA_PORT = "9000"
"""EMBER_K8S_REPLICA_PORT's default (ember/config.py)."""


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs
            if d["kind"] == "Deployment"}  # fmt: skip


def backend_rights(path: Path = BACKEND) -> set[tuple[str, str, str]]:
    """``API_RIGHTS`` of the Kubernetes backend: (API group, resource, verb) of every call
    it and the Lease election make. Read from the source, so that this script needs no
    Ember install (infra/check.sh runs it in .venv-infra)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "API_RIGHTS":
            assert isinstance(node.value, ast.Call) and node.value.args
            return set(ast.literal_eval(node.value.args[0]))
    raise LookupError(f"API_RIGHTS not found in {path}")


def generated(by_kind: dict[str, dict[str, dict[str, Any]]], kind: str, name: str) -> Any:
    """The object ``name`` of ``kind``, under its own or its hash-suffixed name."""
    objs = by_kind.get(kind, {})
    if name in objs:
        return objs[name]
    return next((o for n, o in objs.items() if n.rsplit("-", 1)[0] == name), None)


def role_rights(docs: list[dict[str, Any]], account: str) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) the Roles and ClusterRoles bound to service account
    ``account`` grant ("*" stays "*": never what the backend uses, so reported as extra)."""
    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs
             if d["kind"] in ("Role", "ClusterRole")}  # fmt: skip
    rights: set[tuple[str, str, str]] = set()
    for b in docs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == account
                   for s in b.get("subjects", [])):  # fmt: skip
            continue
        role = roles.get((b["roleRef"]["kind"], b["roleRef"]["name"]))
        for rule in (role or {}).get("rules", []):
            for group in rule.get("apiGroups", []):
                for resource in rule.get("resources", []):
                    rights |= {(group, resource, verb) for verb in rule.get("verbs", [])}
    return rights


def selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether NetworkPolicy ``policy`` selects pods labelled ``labels`` (matchLabels only:
    the manifests use nothing else; a matchExpressions selector counts as not selecting)."""
    selector = policy["spec"].get("podSelector") or {}
    if selector.get("matchExpressions"):
        return False
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _component_peer(peer: dict[str, Any]) -> str | None:
    """The component a ``from``/``to`` peer names, if it is exactly a same-namespace
    podSelector on it."""
    if set(peer) != {"podSelector"}:
        return None
    selector = peer["podSelector"]
    labels = selector.get("matchLabels") or {}
    if selector.get("matchExpressions") or set(labels) != {"app.kubernetes.io/component"}:
        return None
    return str(labels["app.kubernetes.io/component"])


def _is_dns(rule: dict[str, Any]) -> bool:
    to = rule.get("to") or []
    ports = {(p.get("port"), p.get("protocol", "TCP")) for p in rule.get("ports") or []}
    system = {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}
    dns_pods = {"matchLabels": {"k8s-app": "kube-dns"}}
    kube_dns = {"namespaceSelector": system, "podSelector": dns_pods}
    return bool(to) and all(p == kube_dns for p in to) and ports <= {(53, "UDP"), (53, "TCP")}


def _is_public_https(rule: dict[str, Any]) -> bool:
    to = rule.get("to") or []
    ports = [(p.get("port"), p.get("protocol", "TCP")) for p in rule.get("ports") or []]
    public = all(set(peer) == {"ipBlock"} and set(PRIVATE) <= set(peer["ipBlock"].get("except", []))
                 for peer in to)  # fmt: skip
    return bool(to) and ports == [(443, "TCP")] and public


def check_engine_network(by_kind: dict[str, dict[str, dict[str, Any]]], port: str) -> list[str]:
    """Replica pods: reached only by the API and worker pods on the replica port, reaching
    only DNS and public HTTPS (the object store, STS), with no service-account token."""
    errors: list[str] = []
    policies = [p for p in by_kind.get("NetworkPolicy", {}).values() if selects(p, ENGINE_LABELS)]
    kinds = {t for p in policies for t in p["spec"].get("policyTypes", [])}
    for kind in ("Ingress", "Egress"):
        if kind not in kinds:
            errors.append(f"no NetworkPolicy restricts {kind.lower()} of the replica pods "
                          f"{ENGINE_LABELS}")  # fmt: skip
    for policy in policies:
        name = policy["metadata"]["name"]
        for rule in policy["spec"].get("ingress") or []:
            callers = [_component_peer(peer) for peer in rule.get("from") or []]
            if not callers or not set(callers) <= CALLERS:
                errors.append(f"NetworkPolicy {name}: replica ingress from {rule.get('from')}; "
                              f"only pods of {sorted(CALLERS)}")  # fmt: skip
            ports = [(str(p.get("port")), p.get("protocol", "TCP")) for p in rule.get("ports", [])]
            if ports != [(port, "TCP")]:
                errors.append(f"NetworkPolicy {name}: replica ingress on {ports}; only "
                              f"TCP {port} (EMBER_K8S_REPLICA_PORT)")  # fmt: skip
        for rule in policy["spec"].get("egress") or []:
            if not (_is_dns(rule) or _is_public_https(rule)):
                errors.append(f"NetworkPolicy {name}: replica egress {rule} is neither DNS "
                              f"(kube-dns, 53) nor HTTPS (443) to public addresses "
                              f"(except {PRIVATE})")  # fmt: skip
    return errors


def check(docs: list[dict[str, Any]], overlay: bool) -> list[str]:
    errors: list[str] = []
    by_kind: dict[str, dict[str, dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    deployments = by_kind.get("Deployment", {})
    specs = pod_specs(docs)

    for component, subcommand in PROCESSES.items():
        name = f"ember-{component}"
        if name not in deployments:
            errors.append(f"missing Deployment {name}")
            continue
        args = specs[name]["containers"][0].get("args", [])
        if not args or args[0] != subcommand:
            errors.append(f"{name} must run `ember {subcommand}`, runs {args}")

    if "ember-controller" in deployments or "ember-controller" in by_kind.get("ServiceAccount", {}):
        errors.append("no ember-controller: the pools controller runs in the API pods")
    for kind in ("PodTemplate", "ClusterRole", "ClusterRoleBinding"):
        if by_kind.get(kind):
            errors.append(f"unexpected {kind} {sorted(by_kind[kind])}: nothing reads it")

    errors += check_pools(docs, by_kind, specs)

    # Several API pods (the pools controllers among them elect one leader through a Lease)
    # may overlap: rolling updates that never leave none serving.
    api = deployments.get("ember-api")
    if api and (api["spec"]["replicas"] < 2 or api["spec"]["strategy"]["type"] != "RollingUpdate"
                or api["spec"]["strategy"]["rollingUpdate"].get("maxUnavailable") != 0):
        errors.append("ember-api needs two or more replicas and a RollingUpdate with maxUnavailable 0")

    beat = deployments.get("ember-beat")
    if beat and (beat["spec"]["replicas"] != 1 or beat["spec"]["strategy"]["type"] != "Recreate"):
        errors.append("ember-beat must have exactly one replica and the Recreate strategy")

    pdb_selectors = [
        p["spec"]["selector"]["matchLabels"] for p in by_kind.get("PodDisruptionBudget", {}).values()
    ]
    for name, dep in deployments.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        if not any(all(labels.get(k) == v for k, v in sel.items()) for sel in pdb_selectors):
            errors.append(f"{name} has no PodDisruptionBudget")

    for name, spec in specs.items():
        if spec.get("enableServiceLinks") is not False:
            errors.append(f"{name}: enableServiceLinks must be false (EMBER_* service env vars)")
        if not spec.get("securityContext", {}).get("runAsNonRoot"):
            errors.append(f"{name}: must run as non-root")
        for c in spec["containers"]:
            res = c.get("resources", {})
            if not res.get("requests") or not res.get("limits", {}).get("memory"):
                errors.append(f"{name}/{c['name']}: needs resource requests and a memory limit")
            if "livenessProbe" not in c:
                errors.append(f"{name}/{c['name']}: needs a liveness probe")
            if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
                errors.append(f"{name}/{c['name']}: allowPrivilegeEscalation must be false")

    for name in ("ember-api",):
        c = specs.get(name, {}).get("containers", [{}])[0]
        paths = {c.get(p, {}).get("httpGet", {}).get("path") for p in ("livenessProbe", "readinessProbe")}
        if paths != {"/healthz", "/readyz"}:
            errors.append(f"{name}: liveness /healthz and readiness /readyz expected, got {paths}")

    for cm in ("ember-config", "ember-infra", "ember-pools", "ember-engine-config"):
        if not any(n.startswith(cm) for n in by_kind.get("ConfigMap", {})):
            errors.append(f"missing ConfigMap {cm}")
    if overlay:
        if not any(n.startswith("ember-secrets") for n in by_kind.get("Secret", {})):
            errors.append("overlay must generate Secret ember-secrets")
        infra = (generated(by_kind, "ConfigMap", "ember-infra") or {}).get("data", {})
        for name, spec in specs.items():
            image = spec["containers"][0]["image"]
            if not image.count(".dkr.ecr.") or ":" not in image.rsplit("/", 1)[-1]:
                errors.append(f"{name}: overlay image must be the ECR repository with a tag, got {image}")
            elif image != infra.get("IMAGE"):
                errors.append(f"{name}: image {image} is not ember-infra IMAGE {infra.get('IMAGE')}")

    infra = (generated(by_kind, "ConfigMap", "ember-infra") or {}).get("data", {})
    for sa, key in ROLES.items():
        arn = by_kind.get("ServiceAccount", {}).get(sa, {}).get("metadata", {}).get("annotations", {})
        value = arn.get("eks.amazonaws.com/role-arn", "")
        if not value.startswith("arn:aws"):
            errors.append(f"ServiceAccount {sa} needs its IRSA role ARN")
        elif value != infra.get(key):
            errors.append(f"ServiceAccount {sa}: role ARN {value} is not ember-infra {key}")
    return errors


def check_pools(
    docs: list[dict[str, Any]],
    by_kind: dict[str, dict[str, dict[str, Any]]],
    specs: dict[str, dict[str, Any]],
) -> list[str]:
    """The API pods can run the pools controller's Kubernetes backend: its settings, the
    objects they name, and the Kubernetes rights it uses."""
    errors: list[str] = []
    api = specs.get("ember-api")
    if api is None:
        return errors
    container = api["containers"][0]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        cm = generated(by_kind, "ConfigMap", ref["name"]) if ref else None
        env |= (cm or {}).get("data", {})
    env |= {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    missing = sorted(POOLS - set(env))
    if missing:
        errors.append(f"ember-api lacks the pools settings {missing}")
        return errors
    if env["EMBER_REPLICA_BACKEND"] != "kubernetes":
        errors.append("ember-api: EMBER_REPLICA_BACKEND must be kubernetes")
    if env.get("EMBER_CACHE_DIR") != CACHE_DIR:
        errors.append(f"ember-api: EMBER_CACHE_DIR must be {CACHE_DIR} (the NVMe mount)")
    if env["EMBER_K8S_IMAGE"] != container["image"]:
        errors.append(f"EMBER_K8S_IMAGE {env['EMBER_K8S_IMAGE']} is not the API's image "
                      f"{container['image']}")  # fmt: skip
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] == "Deployment"}
    if namespaces != {env["EMBER_K8S_NAMESPACE"]}:
        errors.append(f"EMBER_K8S_NAMESPACE {env['EMBER_K8S_NAMESPACE']} is not the "
                      f"namespace of the Deployments {namespaces}")  # fmt: skip
    engine_sa = by_kind.get("ServiceAccount", {}).get(env["EMBER_K8S_SERVICE_ACCOUNT"])
    if engine_sa is None:
        errors.append(f"EMBER_K8S_SERVICE_ACCOUNT {env['EMBER_K8S_SERVICE_ACCOUNT']} missing")
    elif engine_sa.get("automountServiceAccountToken") is not False:
        errors.append(f"ServiceAccount {env['EMBER_K8S_SERVICE_ACCOUNT']} (replicas) must not "
                      "mount a token (automountServiceAccountToken: false)")  # fmt: skip
    errors += check_engine_network(by_kind, env.get("EMBER_K8S_REPLICA_PORT", DEFAULT_REPLICA_PORT))
    engine_cm = by_kind.get("ConfigMap", {}).get(env["EMBER_K8S_CONFIG_MAP"])
    if engine_cm is None:  # a hash-suffixed name would not match what the backend renders
        errors.append(f"no ConfigMap named exactly {env['EMBER_K8S_CONFIG_MAP']} "
                      "(EMBER_K8S_CONFIG_MAP)")  # fmt: skip
    else:
        config = generated(by_kind, "ConfigMap", "ember-config") or {}
        if engine_cm.get("data") != config.get("data"):
            errors.append(f"{env['EMBER_K8S_CONFIG_MAP']} must hold what ember-config holds")
    infra = (generated(by_kind, "ConfigMap", "ember-infra") or {}).get("data", {})
    if env["EMBER_K8S_STANDBY_ACCELERATORS"] != infra.get("GPU_TYPES"):
        errors.append("EMBER_K8S_STANDBY_ACCELERATORS must be ember-infra GPU_TYPES")

    account = api.get("serviceAccountName", "default")
    sa = by_kind.get("ServiceAccount", {}).get(account, {})
    if sa.get("automountServiceAccountToken") is False and not api.get(
        "automountServiceAccountToken"
    ):
        errors.append(f"ember-api: the token of {account} must be mounted (in-cluster client)")
    used, granted = backend_rights(), role_rights(docs, account)
    lacking = sorted(used - granted)
    extra = sorted(granted - used)
    if lacking:
        errors.append(f"ServiceAccount {account} lacks the rights the backend uses: {lacking}")
    if extra:
        errors.append(f"ServiceAccount {account} has rights the backend never uses: {extra}")
    return errors


def main() -> int:
    path, overlay = sys.argv[1], "--overlay" in sys.argv[2:]
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    errors = check(docs, overlay)
    for e in errors:
        print(f"FAIL {path}: {e}")
    print(f"{path}: {len(docs)} objects, {len(errors)} rule violations")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
