"""bench/autoscale.py runs one scenario from a traces directory and prints its verdict."""

from __future__ import annotations

import json
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
    assert set(verdict) == {
        "bursty_within_slo",
        "bursty_cheapest",
        "bursty_target_met",
        "bursty_cost_vs_static",
    }
    assert 0.0 <= verdict["bursty_within_slo"] <= 100.0
    table = "\n".join(lines)
    for policy in ("ember", "knative", "ray", "static-peak", "reactive-min1"):
        assert f"\n{policy} " in table
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
    assert verdict["sparse_standby_pool"] >= 2  # one process to start with, then learned
    assert verdict["sparse_standby_empty"] >= 0 and 0 <= verdict["sparse_over_slo"] <= 100
    assert "promotion to hot: warm 0.6 s, standby 2.5 s, cold 8 s" in out.stdout
    assert "ember: largest" in out.stdout  # the shared pool's size and use are printed
