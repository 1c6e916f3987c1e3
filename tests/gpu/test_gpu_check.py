"""``scripts/gpu_check.py``'s own machinery, on any machine (no GPU needed): a step stopped
at its limit takes its whole process group with it, the budget keeps time for the later
steps, the JUnit XML of a real pytest run becomes counts and figures, a bench's last JSON
line its key figures, and only the flags a bench has are passed to it. The whole script
runs on the CPU with ``make gpu-check GPU_CHECK_DEVICE=cpu``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


def test_a_step_at_its_limit_is_stopped_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    started = time.monotonic()
    ran = gpu_check.run(["bash", "-c", script], 1.0, log_file=tmp_path / "step.log")
    assert ran.rc is None and time.monotonic() - started < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the orphan is reaped by whoever adopted it
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's child {child} outlived the step")
    assert "# rc=None" in (tmp_path / "step.log").read_text()


def test_a_missing_program_is_a_failed_step_not_a_crash() -> None:
    ran = gpu_check.run(["/nonexistent/python", "-c", "pass"], 5)
    assert ran.rc == 127 and "nonexistent" in ran.tail()


def test_the_budget_keeps_time_for_the_later_steps() -> None:
    budget = gpu_check.Budget(100.0)
    assert 89 < budget.grant(90) <= 90  # its own limit
    assert 69 < budget.grant(90, keep_s=30) <= 70  # 100 s left, 30 kept for later steps
    budget.started -= 95
    assert budget.grant(90, keep_s=30) == 0.0


def test_junit_of_a_real_pytest_run_becomes_counts_and_figures(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok(record_property):\n    record_property('load_s', 0.25)\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_twice(record_property, n):\n    record_property('tier_s', n)\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='needs an NVIDIA GPU')\ndef test_gpu():\n    pass\n"
    )
    junit = tmp_path / "out.xml"
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the suite's plugins stay out
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"--junitxml={junit}", "-o", "junit_family=xunit1", "--rootdir",
                          str(tmp_path), str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr  # 1: a test failed, as written
    got = gpu_check.parse_junit(junit)
    assert (got["passed"], got["failed"], got["errors"], got["skipped"]) == (3, 1, 0, 1)
    assert got["figures"] == {"load_s": 0.25, "tier_s": 1, "tier_s[test_twice[2]]": 2}
    (failure,) = got["failures"]
    assert failure.startswith("test_x::test_bad") and "one is not two" in failure
    assert got["skip_reasons"] == {"needs an NVIDIA GPU": 1}


def test_a_benchs_last_json_line_gives_its_key_figures() -> None:
    out = '# writing ...\n{"not": "last"}\ntable\n' + (
        '{"ember_cold_gbps": 5.1, "device": "cuda", "limits_gbps": {"disk": 6.0}, '
        '"loaders": {"a": {"cold": 1}}, "tiers": [1, 2]}\n'
    )
    doc = gpu_check.last_json(out)
    assert doc is not None and gpu_check.key_figures(doc) == {
        "ember_cold_gbps": 5.1, "device": "cuda", "limits_gbps": {"disk": 6.0},
    }  # fmt: skip
    assert gpu_check.last_json("no json here\n") is None


def test_only_the_flags_a_bench_has_are_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "fake.py").write_text(
        "import argparse\nap = argparse.ArgumentParser()\nap.add_argument('--runs')\n"
        "ap.add_argument('--s3', action=argparse.BooleanOptionalAction)\nap.parse_args()\n"
    )
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    wanted = ["--size-gib", "2", "--runs", "1", "--no-s3", "--shards", "4"]
    flags = gpu_check.bench_flags(None, {"python": sys.executable}, "fake", wanted)
    assert flags == ["--runs", "1", "--no-s3"]
