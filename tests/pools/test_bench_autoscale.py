"""bench/autoscale.py runs one scenario from a traces directory and prints its verdict."""

from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def write_azure(path: Path, seconds: np.ndarray) -> None:
    start = datetime(2023, 11, 16, 18, 0, 0)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for s in seconds:
        stamp = start + timedelta(seconds=float(s))
        lines.append(f"{stamp:%Y-%m-%d %H:%M:%S}.{stamp.microsecond:06d}0,1000,20")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def test_bursty_scenario_alone(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    steady = np.sort(rng.uniform(0, 900, 900))  # ~1 req/s for 15 minutes
    bursts = np.concatenate([t + rng.uniform(0, 1, 40) for t in (300.0, 600.0)])
    write_azure(
        tmp_path / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv",
        np.sort(np.concatenate([steady, bursts])),
    )
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "autoscale.py"),
            "--scenario",
            "bursty",
            "--traces-dir",
            str(tmp_path),
            "--processes",
            "1",
            "--detail",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = out.stdout.strip().splitlines()
    verdict = json.loads(lines[-1])
    # Every profile, its own keys.
    assert set(verdict) == {
        f"{p}_bursty_{k}"
        for p in ("cpu", "gpu_shared", "gpu_dedicated")
        for k in ("within_slo", "cheapest", "target_met", "cost_vs_static")
    }
    assert all(0.0 <= verdict[f"{p}_bursty_within_slo"] <= 100.0
               for p in ("cpu", "gpu_shared", "gpu_dedicated"))  # fmt: skip
    table = "\n".join(lines)
    for policy in ("ember", "knative", "ray", "ray@8", "knative+cron", "static-peak",
                   "reactive-min1"):  # fmt: skip
        assert f"\n{policy} " in table
    assert "[cpu] bursty: Azure LLM 2023 code" in table
    # Each table says what it assumed: the profile's promotion times and tier costs.
    assert (
        "profile gpu-dedicated: promotion warm 2 s, standby 20 s, cold 120 s; cost per "
        "replica-second hot 1, warm 1, standby 1" in table
    )
    assert "bursty/ember: SLO misses" in table
    assert "dense" not in table and "sparse" not in table  # only the scenario asked for


def write_servegen(directory: Path, rates: list[list[float]]) -> None:
    """One ServeGen client file per row of ``rates`` (req/s per 10-minute window)."""
    directory.mkdir(parents=True, exist_ok=True)
    for n, client in enumerate(rates):
        rows = [f"{600 * k},{r},1.0,{'Gamma' if r else ''},{1.0 if r else 0},0" for k, r in
                enumerate(client)]  # fmt: skip
        (directory / f"chunk-{n}-trace.csv").write_text("\n".join(rows) + "\n")


def test_sparse_scenario_shares_one_causal_standby_pool(tmp_path: Path) -> None:
    # Three sparse clients that wake up now and then over two hours.
    rates = [
        [0.02, 0, 0, 0.03, 0, 0, 0, 0.02, 0, 0, 0, 0.04],
        [0, 0.01, 0, 0.03, 0, 0, 0, 0, 0.02, 0, 0, 0.04],
        [0.04, 0, 0, 0, 0, 0.02, 0, 0, 0, 0, 0.01, 0.04],
    ]
    write_servegen(tmp_path / "servegen" / "language" / "m-large", rates)
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "autoscale.py"), "--scenario", "sparse",
         "--traces-dir", str(tmp_path), "--processes", "1"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    lines = out.stdout.strip().splitlines()
    verdict = json.loads(lines[-1])
    for p in ("cpu", "gpu_shared", "gpu_dedicated"):
        assert verdict[f"{p}_sparse_standby_pool"] >= 2  # one to start with, then learned
        assert verdict[f"{p}_sparse_standby_empty"] >= 0
        assert 0 <= verdict[f"{p}_sparse_over_slo"] <= 100
        assert verdict[f"{p}_sparse_cost_vs_knative"] > 0
    assert "promotion to hot: warm 0.6 s, standby 2.5 s, cold 8 s" in out.stdout
    assert "ember: largest" in out.stdout  # the shared pool's size and use are printed


def test_a_worker_sends_back_figures_not_the_runs_arrays(tmp_path: Path) -> None:
    # Over the whole dense trace, every run's per-request arrays sent to the parent at once
    # were 19 GiB: a worker's answer is its row (and its --detail text) only.
    spec = importlib.util.spec_from_file_location(
        "bench_autoscale", ROOT / "bench" / "autoscale.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rng = np.random.default_rng(1)
    write_azure(
        tmp_path / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv",
        np.sort(rng.uniform(0, 600, 3000)),  # ~5 req/s for 10 minutes
    )
    bench.load(tmp_path, ("bursty",), {})
    requests = len(bench._TRACES["bursty"][0])
    for with_detail in (False, True):
        profile, scenario, policy, row, text, seconds = bench._job(
            ("cpu", "bursty", "ember", with_detail)
        )
        assert (profile, scenario, policy) == ("cpu", "bursty", "ember")
        assert 0 <= row["over_slo_pct"] <= 100 and all(isinstance(v, float) for v in row.values())
        assert ("bursty/ember: SLO misses" in text) is with_detail
        assert seconds > 0
        # a few hundred bytes of figures, not 8 bytes and more per request
        assert len(pickle.dumps((row, text))) < requests
