"""Trace readers and the synthetic generator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from ember.pools.traces import (
    default_traces_dir,
    read_azure,
    read_servegen_client,
    servegen_trace,
    synthetic,
)

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.5000000,110,27
"""


def test_azure_reader(tmp_path: Path) -> None:
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_text(AZURE)
    tr = read_azure(path)
    assert tr.name == "code" and len(tr) == 3
    assert np.allclose(tr.arrivals_s, [0.0, 0.052, 1.52004])
    assert tr.input_size.tolist() == [4808, 3180, 110] and tr.output_size[2] == 27


def test_servegen_arrivals_follow_window_rates_and_seed(tmp_path: Path) -> None:
    path = tmp_path / "chunk-0-trace.csv"
    path.write_text("0,2.0,3.0,Gamma,0.2,2.5\n600,0,0,,0,0\n1200,0.5,1.0,Weibull,0.8,1.9\n")
    client = read_servegen_client(path)
    a = servegen_trace([client], seed=1)
    b = servegen_trace([client], seed=1)
    assert np.array_equal(a.arrivals_s, b.arrivals_s)
    t = a.arrivals_s
    assert not ((t >= 600) & (t < 1200)).any()  # the empty window stays empty
    # 2 req/s for 600 s = 1200 expected; bursty (CV 3), so within a wide band
    assert 600 < ((t >= 0) & (t < 600)).sum() < 1800
    scaled = servegen_trace([client], seed=1, mean_rps=client.mean_rps * 2)
    assert 1.5 < len(scaled) / len(a) < 2.5


def test_synthetic_is_seeded_and_diurnal() -> None:
    a = synthetic(1, 7200.0, 5.0, period_s=7200.0)
    assert np.array_equal(a.arrivals_s, synthetic(1, 7200.0, 5.0, period_s=7200.0).arrivals_s)
    first, second = (a.arrivals_s < 3600).sum(), (a.arrivals_s >= 3600).sum()
    assert first > second  # the sine's positive half comes first
    assert abs(len(a) / 7200.0 - 5.0) < 0.5


def test_traces_dir_is_next_to_the_repository() -> None:
    assert (
        default_traces_dir().resolve()
        == (Path(__file__).resolve().parents[3] / "shared" / "traces").resolve()
    )


def test_simulate_command(tmp_path: Path) -> None:
    import typer

    from ember.cli.simulate import simulate_command

    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_text(AZURE)
    app = typer.Typer()
    app.command()(simulate_command)
    out = CliRunner().invoke(app, ["--trace", str(path), "--policy", "all", "--warmup-s", "0"])
    assert out.exit_code == 0, out.output
    for name in ("ember", "knative", "ray", "static-peak", "reactive-min1"):
        assert name in out.output
    # The promotion times used are printed: by default the measured ones, the bench's too.
    assert "promotion to hot: warm 0.6 s, standby 2.5 s, cold 8 s (bench/coldstart.py" in out.output
    flags = ["--trace", str(path), "--warmup-s", "0", "--cold-s", "20", "--json"]
    custom = CliRunner().invoke(app, flags)
    assert custom.exit_code == 0, custom.output
    assert "cold 20 s (set by flags)" in custom.output
    assert json.loads(custom.output.strip().splitlines()[-1])["promotion"]["cold_s"] == 20.0
