#!/usr/bin/env python3
"""``make gpu-check``: everything Ember does on an NVIDIA GPU, checked in one command, in
under 8 minutes, ending in one JSON line of figures.

    make gpu-check                          # on a machine with an NVIDIA GPU
    make gpu-check GPU_CHECK_DEVICE=cpu     # a dry run of the same steps on the CPU
    python3 scripts/gpu_check.py --help     # limits, interpreter, wheelhouse, ...

Written to run unchanged on a machine seen for the first time, with or without a network.
Standard library only (it runs under whatever ``python3`` the machine has). Steps, each
with its own time limit inside one overall budget (a step that runs out is stopped with
its whole process group and reported; the next steps still run):

1. **device**: ``nvidia-smi`` (name, driver, memory) and the chosen interpreter's
   ``torch.cuda`` (device name, CUDA version).
2. **env**: an interpreter whose torch sees the device and that imports Ember and the test
   dependencies. Tried in order: ``--python`` / ``$GPU_CHECK_PYTHON``, ``.venv``, the
   virtualenv an earlier run built (``build/gpu-check/venv``), ``python3``, ``python3.11``,
   ``python3.12``, ``python``. None complete: a virtualenv is built on the best one (its
   torch and every other package it has stay visible through a ``.pth`` file: nothing
   big is installed twice) and Ember is installed into it (``pip install -e .`` plus
   pytest; from ``--wheels DIR`` first when given, for a machine without a network). No
   interpreter with a CUDA torch at all: ``pip install torch`` into that virtualenv, with a
   time limit (not on a machine with no NVIDIA driver: nothing is installed there). Each
   failure is reported with pip's own last lines.
3. **tests**: ``pytest tests/gpu`` with ``TEST_DEVICE`` set (loader to the device through
   the pinned ring and side streams, single-file and sharded; torch and transformers
   engines; tier changes with their timings; vLLM sleep/wake where a vLLM GPU build is
   importable). Counts and every ``record_property`` figure come from its JUnit XML.
4. **bench_loader**: ``bench/loader.py --device DEVICE`` (small: ``--loader-size-gib``,
   one run, no S3); its last JSON line's figures.
5. **bench_coldstart**: ``bench/coldstart.py --device DEVICE`` (one run, no S3; on the CPU
   ``--only models``: vLLM on the CPU takes minutes to start) with what the budget has
   left; its last JSON line's figures.

The last line on stdout is the JSON object; progress goes to stderr; every step's output
is kept under ``--out`` (default ``build/gpu-check``). Exit status 0 when every step ran
and no test failed."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TORCH_VERSION = "2.13.0"
"""What ``pip install torch`` asks for when no interpreter has a CUDA torch (pyproject's pin)."""
NEEDED = ("ember.config", "ember.loader.load", "ember.registry.validation",
          "ember.engine.torch_engine", "ember.engine.transformers_engine", "ember.cli",
          "pytest", "pytest_timeout", "safetensors", "transformers", "huggingface_hub",
          "httpx", "numpy")  # fmt: skip
"""What the tests and benches import; the first one missing is reported."""
PROBE = r"""
import importlib, json, sys
out = {"python": sys.executable, "prefix": sys.prefix, "version": sys.version.split()[0],
       "missing": None}
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["cuda"] = bool(torch.cuda.is_available())
    if out["cuda"]:
        out["device_name"] = torch.cuda.get_device_name(0)
        out["device_count"] = torch.cuda.device_count()
except Exception as exc:
    out["torch"], out["cuda"], out["torch_error"] = None, False, f"{type(exc).__name__}: {exc}"
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        out["missing"] = f"{name} ({type(exc).__name__}: {str(exc)[:200]})"
        break
import sysconfig
out["paths"] = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
print("GPU_CHECK_PROBE " + json.dumps(out))
"""


def log(message: str) -> None:
    print(f"# gpu-check: {message}", file=sys.stderr, flush=True)


@dataclass
class Budget:
    """One deadline for the whole check; each step gets its own limit, never more than
    what is left after keeping the later steps' minimums."""

    total_s: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.started)

    def grant(self, limit_s: float, keep_s: float = 0.0) -> float:
        return max(0.0, min(limit_s, self.left() - keep_s))


@dataclass
class Ran:
    rc: int | None
    """None: stopped at its time limit."""
    seconds: float
    stdout: str
    stderr: str

    def tail(self, n: int = 1500) -> str:
        return (self.stderr.strip() or self.stdout.strip())[-n:]


def run(cmd: list[str], timeout_s: float, *, env: dict[str, str] | None = None,
        log_file: Path | None = None, cwd: Path = ROOT) -> Ran:  # fmt: skip
    """``cmd`` in a process group of its own; at the limit the whole group is stopped
    (pytest's engines, a bench's replicas and vLLM's workers with it)."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        except OSError as exc:
            return Ran(127, 0.0, "", f"{cmd[0]}: {exc}")
        rc: int | None
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            rc = None
        _stop_group(proc)
        out.seek(0)
        err.seek(0)
        ran = Ran(rc, time.monotonic() - t0, out.read().decode(errors="replace"),
                  err.read().decode(errors="replace"))  # fmt: skip
    if log_file is not None:
        log_file.write_text(f"$ {' '.join(cmd)}\n# rc={rc} in {ran.seconds:.1f} s\n"
                            f"{ran.stdout}\n--- stderr ---\n{ran.stderr}")  # fmt: skip
    return ran


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Whatever the step left running in its process group, stopped (TERM, then KILL)."""
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; its group may not be: one more round catches stragglers
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            return value if isinstance(value, dict) else None
    return None


def key_figures(doc: dict[str, Any]) -> dict[str, Any]:
    """A bench's JSON line without its bulky parts: the scalars, and small flat maps."""

    def scalar(value: Any) -> bool:
        return value is None or isinstance(value, (int, float, str, bool))

    def small(value: Any) -> bool:
        return isinstance(value, dict) and len(value) <= 8 and all(map(scalar, value.values()))

    return {k: v for k, v in doc.items() if scalar(v) or small(v)}


# --- 1. the device ---------------------------------------------------------------------
def nvidia_smi(timeout_s: float) -> tuple[dict[str, Any], str | None]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}, "nvidia-smi not found"
    fields = "name,driver_version,memory.total,memory.used,compute_cap"
    ran = run([smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"], timeout_s)
    if ran.rc != 0:
        return {}, f"nvidia-smi failed: {ran.tail(300)}"
    gpus = []
    for line in ran.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            gpus.append({"name": parts[0], "driver": parts[1], "memory_mib": _num(parts[2]),
                         "used_mib": _num(parts[3]),
                         "compute_cap": parts[4] if len(parts) > 4 else None})  # fmt: skip
    if not gpus:
        return {}, "nvidia-smi lists no GPU"
    return {"gpus": gpus, "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}, None


def _num(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


# --- 2. the environment ----------------------------------------------------------------
def probe(python: str, timeout_s: float) -> dict[str, Any] | None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ran = run([python, "-c", PROBE, *NEEDED], timeout_s, env=_clean(env))
    for line in ran.stdout.splitlines():
        if line.startswith("GPU_CHECK_PROBE "):
            found: dict[str, Any] = json.loads(line.removeprefix("GPU_CHECK_PROBE "))
            return found
    return None


def _clean(env: dict[str, str]) -> dict[str, str]:
    """No EMBER_* setting from the caller's shell: ember refuses unknown ones, and the
    tests and benches choose their own."""
    return {k: v for k, v in env.items() if not k.startswith("EMBER_")}


def candidates(args: argparse.Namespace, venv: Path) -> list[str]:
    names = [args.python or os.environ.get("GPU_CHECK_PYTHON") or "",
             str(ROOT / ".venv" / "bin" / "python"), str(venv / "bin" / "python"),
             "python3", "python3.11", "python3.12", "python"]  # fmt: skip
    out: list[str] = []
    for name in names:
        path = shutil.which(name) if name and "/" not in name else name
        if path and Path(path).exists() and path not in out:
            out.append(path)
    return out


def usable(found: dict[str, Any], device: str) -> bool:
    return bool(found.get("torch")) and (device == "cpu" or bool(found.get("cuda")))


def find_env(args: argparse.Namespace, budget: Budget, keep_s: float) -> dict[str, Any]:
    """The interpreter the tests and benches run under (see the module docstring)."""
    venv = args.out / "venv"
    seen: dict[str, dict[str, Any]] = {}
    tried = []
    for python in candidates(args, venv):
        found = probe(python, budget.grant(90, keep_s))
        if found is None:
            tried.append(f"{python}: does not run")
            continue
        if found["prefix"] in seen:
            continue
        seen[found["prefix"]] = found
        torch = found.get("torch") or f"no torch ({found.get('torch_error', 'not installed')})"
        tried.append(f"{python}: torch {torch}, cuda {found.get('cuda')}, "
                     f"missing {found.get('missing')}")  # fmt: skip
        if usable(found, args.device) and found["missing"] is None:
            return {**found, "how": "found", "tried": tried}
    base = next((f for f in seen.values() if usable(f, args.device)), None)
    if base is None and args.device != "cpu" and not driver_present():
        # Nothing to install torch for: GBs of CUDA wheels would find no device either.
        return {
            "error": "no NVIDIA driver here (no nvidia-smi, /dev/nvidia*, "
            "/proc/driver/nvidia) and no interpreter whose torch sees CUDA",
            "tried": tried,
        }
    if args.no_install:
        return {**_fallback(base, "no complete interpreter, and --no-install"), "tried": tried}
    built = build_env(args, budget, keep_s, venv, base, tried)
    built["tried"] = tried
    return built


def driver_present() -> bool:
    return bool(shutil.which("nvidia-smi") or list(Path("/dev").glob("nvidia[0-9]*"))
                or Path("/proc/driver/nvidia/version").exists())  # fmt: skip


def build_env(args: argparse.Namespace, budget: Budget, keep_s: float, venv: Path,
              base: dict[str, Any] | None, tried: list[str]) -> dict[str, Any]:  # fmt: skip
    """A virtualenv on ``base`` (its packages visible through a .pth file) with Ember and
    pytest installed; with no usable base, torch too."""
    creator = base["python"] if base else shutil.which("python3.11") or shutil.which("python3")
    if creator is None:
        return {"error": "no python3 on this machine"}
    if not (venv / "bin" / "python").exists():
        made = run([creator, "-m", "venv", str(venv)], budget.grant(120, keep_s))
        if made.rc != 0:
            return _fallback(base, f"python -m venv failed: {made.tail(400)}")
    if base is not None:  # the base's torch (and all else it has) seen from the venv
        site = probe_paths(venv)
        if site is None:
            return _fallback(base, "the new virtualenv does not run")
        (Path(site) / "_gpu_check_base.pth").write_text("\n".join(base["paths"]) + "\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
           "--timeout", "15", "--retries", "1"]  # fmt: skip
    wants = ["-e", str(ROOT), "pytest>=8", "pytest-timeout>=2.3", "transformers>=4.50"]
    constraints = args.out / "constraints.txt"
    if base is not None:
        constraints.write_text(f"torch=={base['torch']}\n")  # never replaced by pip
    else:
        wants.append(f"torch=={TORCH_VERSION}")  # PyPI's Linux wheel: a CUDA build (GBs)
        constraints.write_text("")
    pip += ["-c", str(constraints)]
    if has_setuptools(venv):
        pip.append("--no-build-isolation")  # build Ember with what is there, offline too
    sources = ([["--no-index", "--find-links", str(args.wheels)]] if args.wheels else []) + [[]]
    errors = []
    for source in sources:
        grant = budget.grant(args.install_s, keep_s)
        if grant < 10:
            errors.append("no time left to install")
            break
        log(f"installing into {venv} ({'wheelhouse' if source else 'index'}, {grant:.0f} s)")
        ran = run([*pip, *source, *wants], grant, log_file=args.out / "install.log")
        if ran.rc == 0:
            found = probe(str(venv / "bin" / "python"), budget.grant(90, keep_s))
            if found and usable(found, args.device) and found["missing"] is None:
                how = "venv on " + (base["python"] if base else f"pip torch=={TORCH_VERSION}")
                return {**found, "how": how}
            errors.append(f"installed, but: {found}")
        else:
            why = "timed out" if ran.rc is None else f"exit {ran.rc}"
            errors.append(f"pip install {why}: {ran.tail(600)}")
    tried.append(f"{venv}: " + " | ".join(errors))
    return _fallback(base, "could not install Ember's dependencies: " + " | ".join(errors))


def probe_paths(venv: Path) -> str | None:
    """The virtualenv's site-packages directory (None: it does not run)."""
    ran = run([str(venv / "bin" / "python"), "-c",
               "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 30)  # fmt: skip
    if ran.rc != 0 or not ran.stdout.strip():
        return None
    return ran.stdout.strip()


def has_setuptools(venv: Path) -> bool:
    """Whether Ember can be built without fetching setuptools (no network needed)."""
    check = "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)"
    return run([str(venv / "bin" / "python"), "-c", check], 30).rc == 0


def _fallback(base: dict[str, Any] | None, error: str) -> dict[str, Any]:
    """The base interpreter as it is (Ember from the source tree): the steps then fail
    on what is missing, each saying what."""
    if base is None:
        return {"error": error}
    return {**base, "how": "as found, incomplete", "error": error}


# --- 3. the tests ----------------------------------------------------------------------
def run_tests(args: argparse.Namespace, env_info: dict[str, Any], grant: float) -> dict[str, Any]:
    junit = args.out / "tests.xml"
    junit.unlink(missing_ok=True)
    cmd = [env_info["python"], "-m", "pytest", "tests/gpu", "-q", "-rfEs", "-p",
           "no:cacheprovider", f"--junitxml={junit}", "-o", "junit_family=xunit1",
           *args.pytest_args]  # fmt: skip
    env = _clean({**os.environ, "TEST_DEVICE": args.device, "PYTHONPATH": str(ROOT),
                  "PYTHONUNBUFFERED": "1"})  # fmt: skip
    ran = run(cmd, grant, env=env, log_file=args.out / "tests.log")
    result: dict[str, Any] = {"rc": ran.rc, "seconds": round(ran.seconds, 1)}
    if junit.exists():
        result |= parse_junit(junit)
    if ran.rc is None:
        result["error"] = f"stopped at its limit ({grant:.0f} s)"
    elif ran.rc not in (0, 1) or not junit.exists():  # 1: tests failed (counted above)
        result["error"] = f"pytest exited {ran.rc}: {ran.tail(800)}"
    return result


def parse_junit(path: Path) -> dict[str, Any]:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    figures: dict[str, Any] = {}
    failures: list[str] = []
    skips: dict[str, int] = {}
    for case in ET.parse(path).getroot().iter("testcase"):  # noqa: S314 - our own pytest's file
        name = f"{case.get('classname', '')}.{case.get('name', '')}".rsplit(".", 2)
        test_id = "::".join(name[-2:])
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                message = (child.get("message") or child.text or "").strip().splitlines()
                failures.append(f"{test_id}: {message[0][:300] if message else child.tag}")
            elif child.tag == "skipped":
                outcome = "skipped"
                reason = (child.get("message") or "").strip()[:200]
                skips[reason] = skips.get(reason, 0) + 1
            elif child.tag == "properties":
                for prop in child.iter("property"):
                    key, value = prop.get("name", ""), prop.get("value", "")
                    if key in figures:
                        key = f"{key}[{case.get('name', '')}]"
                    figures[key] = _value(value)
        counts[outcome] += 1
    return {**counts, "failures": failures, "skip_reasons": skips, "figures": figures}


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# --- 4, 5. the benches -----------------------------------------------------------------
def run_bench(args: argparse.Namespace, env_info: dict[str, Any], name: str, extra: list[str],
              grant: float) -> dict[str, Any]:  # fmt: skip
    script = str(ROOT / "bench" / f"{name}.py")
    cmd = [env_info["python"], script, "--device", args.device, *extra]
    env = _clean({**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
    ran = run(cmd, grant, env=env, log_file=args.out / f"{name}.log")
    result: dict[str, Any] = {"rc": ran.rc, "seconds": round(ran.seconds, 1)}
    doc = last_json(ran.stdout)
    if doc is not None:
        result["figures"] = key_figures(doc)
    if ran.rc is None:
        result["error"] = f"stopped at its limit ({grant:.0f} s)"
    elif ran.rc != 0:
        result["error"] = f"bench/{name}.py exited {ran.rc}: {ran.tail(600)}"
    elif doc is None:
        result["error"] = f"bench/{name}.py printed no JSON line"
    return result


def bench_flags(args: argparse.Namespace, env_info: dict[str, Any], name: str,
                wanted: list[str]) -> list[str]:  # fmt: skip
    """The flags of ``wanted`` (``--flag value`` pairs or ``--switch``) that the bench
    has; a bench that has none of them, or no ``--help``, gets them all (and says why)."""
    ran = run([env_info["python"], str(ROOT / "bench" / f"{name}.py"), "--help"], 60,
              env=_clean({**os.environ, "PYTHONPATH": str(ROOT)}))  # fmt: skip
    if ran.rc != 0:
        return wanted
    out, i = [], 0
    while i < len(wanted):
        flag = wanted[i]
        takes_value = i + 1 < len(wanted) and not wanted[i + 1].startswith("--")
        if flag.split("=")[0] in ran.stdout:
            out += wanted[i : i + 2] if takes_value else [flag]
        i += 2 if takes_value else 1
    return out


# --- the whole check -------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (dry run)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=450,
        help="the whole check (8 min less what stopping a step may take)",
    )
    ap.add_argument("--tests-s", type=float, default=240, help="limit of the CUDA tests")
    ap.add_argument("--loader-s", type=float, default=150, help="limit of bench/loader.py")
    ap.add_argument(
        "--coldstart-s",
        type=float,
        default=None,
        help="limit of bench/coldstart (default: what the budget has left)",
    )
    ap.add_argument("--coldstart-only", choices=("all", "models", "llm"), default=None,
                    help="its --only; default all on CUDA, models on the CPU (vLLM on the "
                         "CPU takes minutes to start)")  # fmt: skip
    ap.add_argument("--install-s", type=float, default=240, help="limit of each pip install")
    ap.add_argument("--loader-size-gib", type=float, default=2.0)
    ap.add_argument("--python", help="the interpreter to use (else the first complete one)")
    ap.add_argument("--wheels", type=Path, help="a wheelhouse to install from, no network")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-check")
    ap.add_argument("--no-bench", action="store_true", help="the tests only")
    ap.add_argument("--no-install", action="store_true",
                    help="use an interpreter as found; never build a virtualenv")  # fmt: skip
    ap.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[],
                    help="the rest goes to pytest (e.g. -k loader)")  # fmt: skip
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    summary: dict[str, Any] = {"gpu_check": "failed", "device": args.device}
    errors: dict[str, str] = {}
    durations: dict[str, float] = {}

    def step(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        log(f"{name} ({budget.left():.0f} s left)")
        try:
            return fn()
        finally:
            durations[name] = round(time.monotonic() - t0, 1)

    cuda = args.device.startswith("cuda")
    smi, smi_error = step("device", lambda: nvidia_smi(20)) if cuda else ({}, None)
    summary |= smi
    if smi_error:
        errors["device"] = smi_error
    keep = 60.0 if args.no_bench else 180.0  # what the later steps need at the least
    env_info = step("env", lambda: find_env(args, budget, keep))
    summary |= {k: env_info.get(k) for k in ("python", "version", "torch", "torch_cuda",
                                             "device_name", "device_count", "how")}  # fmt: skip
    summary["env_tried"] = env_info.get("tried", [])
    if env_info.get("error"):
        errors["env"] = env_info["error"]
    ready = bool(env_info.get("python")) and usable(env_info, args.device)
    if cuda and not ready and "env" not in errors:
        errors["env"] = "no interpreter whose torch sees a CUDA device"
    if ready:
        keep_tests = 0.0 if args.no_bench else 120.0
        grant = budget.grant(args.tests_s, keep_tests)
        tests = step("tests", lambda: run_tests(args, env_info, grant))
        summary["tests"] = {k: v for k, v in tests.items() if k != "figures"}
        summary["test_figures"] = tests.get("figures", {})
        if tests.get("error"):
            errors["tests"] = tests["error"]
        if not args.no_bench:
            size = f"{args.loader_size_gib:g}"
            wanted = ["--size-gib", size, "--runs", "1", "--no-s3", "--shards", "4"]
            flags = bench_flags(args, env_info, "loader", wanted)
            grant = budget.grant(args.loader_s, 60)
            loader = step("bench_loader",
                          lambda: run_bench(args, env_info, "loader", flags, grant))  # fmt: skip
            summary["bench_loader"] = loader
            if loader.get("error"):
                errors["bench_loader"] = loader["error"]
            only = args.coldstart_only or ("all" if cuda else "models")
            wanted = ["--runs", "1", "--no-s3", "--only", only]
            flags = bench_flags(args, env_info, "coldstart", wanted)
            grant = budget.grant(args.coldstart_s or budget.left())
            cold = step("bench_coldstart",
                        lambda: run_bench(args, env_info, "coldstart", flags, grant))  # fmt: skip
            summary["bench_coldstart"] = cold
            if cold.get("error"):
                errors["bench_coldstart"] = cold["error"]
    failed = summary.get("tests", {}).get("failed", 0) + summary.get("tests", {}).get("errors", 0)
    summary["gpu_check"] = "passed" if not errors and not failed and ready else "failed"
    summary["errors"] = errors
    summary["durations_s"] = durations
    summary["wall_s"] = round(time.monotonic() - budget.started, 1)
    summary["logs"] = str(args.out)
    print(json.dumps(summary, default=str), flush=True)
    return 0 if summary["gpu_check"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
