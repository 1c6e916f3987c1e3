"""Ember-specific rules on rendered manifests, beyond schema validation.

usage: python check_manifests.py RENDERED.yaml [--overlay]
Exits 1 listing every violation. Run by infra/check.sh after kubernetes-validate.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

CACHE_DIR = "/mnt/nvme/ember-cache"
PROCESSES = {"api": "serve", "controller": "controller", "worker": "worker", "beat": "beat"}


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    specs = {}
    for d in docs:
        if d["kind"] == "Deployment":
            specs[d["metadata"]["name"]] = d["spec"]["template"]["spec"]
        elif d["kind"] == "PodTemplate":
            specs[d["metadata"]["name"]] = d["template"]["spec"]
    return specs


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

    errors += check_engine(specs.get("ember-engine"))

    for cm in ("ember-config", "ember-infra"):
        if not any(n.startswith(cm) for n in by_kind.get("ConfigMap", {})):
            errors.append(f"missing ConfigMap {cm}")
    if overlay:
        if not any(n.startswith("ember-secrets") for n in by_kind.get("Secret", {})):
            errors.append("overlay must generate Secret ember-secrets")
        for name, spec in specs.items():
            image = spec["containers"][0]["image"]
            if not image.count(".dkr.ecr.") or ":" not in image.rsplit("/", 1)[-1]:
                errors.append(f"{name}: overlay image must be the ECR repository with a tag, got {image}")

    for sa in ("ember-api", "ember-worker", "ember-controller", "ember-engine"):
        arn = by_kind.get("ServiceAccount", {}).get(sa, {}).get("metadata", {}).get("annotations", {})
        if not arn.get("eks.amazonaws.com/role-arn", "").startswith("arn:aws"):
            errors.append(f"ServiceAccount {sa} needs its IRSA role ARN")
    return errors


def check_engine(spec: dict[str, Any] | None) -> list[str]:
    if spec is None:
        return ["missing PodTemplate ember-engine"]
    errors = []
    c = spec["containers"][0]
    res = c["resources"]
    if str(res.get("limits", {}).get("nvidia.com/gpu")) != "1":
        errors.append("engine must request one nvidia.com/gpu")
    env = {e["name"]: e for e in c.get("env", [])}
    omp = env.get("OMP_NUM_THREADS", {}).get("valueFrom", {}).get("resourceFieldRef", {})
    if omp.get("resource") != "limits.cpu":
        errors.append("engine OMP_NUM_THREADS must come from limits.cpu")
    cache = [v for v in spec["volumes"] if v.get("hostPath", {}).get("path") == CACHE_DIR]
    if not cache or cache[0]["hostPath"].get("type") != "Directory":
        errors.append(f"engine needs hostPath {CACHE_DIR} of type Directory")
    elif not any(m["name"] == cache[0]["name"] and m["mountPath"] == CACHE_DIR for m in c["volumeMounts"]):
        errors.append(f"engine must mount the cache at {CACHE_DIR} (EMBER_CACHE_DIR)")
    if not any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", [])):
        errors.append("engine must tolerate the nvidia.com/gpu taint")
    paths = {c.get(p, {}).get("httpGet", {}).get("path") for p in ("livenessProbe", "readinessProbe")}
    if paths != {"/healthz", "/readyz"}:
        errors.append(f"engine: liveness /healthz and readiness /readyz expected, got {paths}")
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
