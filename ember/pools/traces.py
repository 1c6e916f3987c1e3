"""Workload traces: readers for the public traces and a seeded synthetic generator.

A :class:`Trace` is sorted arrival times (seconds from the trace start) with each
request's input and output size. The simulator turns sizes into model units with the
deployment's :class:`~ember.costmodel.CostModel`.

- Azure LLM inference 2023 (``code``, ``conv``): real timestamps and token counts.
- ServeGen (Alibaba): one row per client per 10-minute window with the mean rate and a
  fitted inter-arrival distribution (Gamma or Weibull). Arrivals inside a window are drawn
  from that distribution, rescaled to the window's real mean rate (the fitted mean does not
  always match it), seeded. ServeGen carries no token counts, so request sizes are drawn
  (seeded) from the Azure ``conv`` pairs when that file is there.
- :func:`synthetic`: diurnal sine plus bursts, Poisson arrivals; for tests.

Attribution: the Azure trace is CC BY 4.0 (Microsoft), ServeGen is Apache-2.0 (Alibaba).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

SERVEGEN_WINDOW_S = 600.0


def default_traces_dir() -> Path:
    """``../shared/traces`` next to the repository root (where CI puts a copy)."""
    return Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"


@dataclass(frozen=True)
class Trace:
    """Arrivals (seconds, sorted) with per-request input and output sizes."""

    name: str
    arrivals_s: FloatArray
    input_size: FloatArray
    output_size: FloatArray
    duration_s: float

    def __post_init__(self) -> None:
        n = len(self.arrivals_s)
        if len(self.input_size) != n or len(self.output_size) != n:
            raise ValueError("arrivals and sizes differ in length")

    def __len__(self) -> int:
        return len(self.arrivals_s)

    @property
    def mean_rps(self) -> float:
        return len(self) / self.duration_s if self.duration_s > 0 else 0.0


@dataclass(frozen=True)
class ServeGenClient:
    """One ServeGen client: per-window mean rate and fitted inter-arrival distribution."""

    name: str
    window_start_s: FloatArray
    rate_rps: FloatArray
    dist: tuple[str, ...]
    shape: FloatArray

    @property
    def mean_rps(self) -> float:
        return float(self.rate_rps.mean()) if len(self.rate_rps) else 0.0

    @property
    def duration_s(self) -> float:
        return float(len(self.rate_rps) * SERVEGEN_WINDOW_S)


def read_azure(path: Path) -> Trace:
    """Azure LLM 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``) to a trace."""
    stamps: list[float] = []
    inputs: list[float] = []
    outputs: list[float] = []
    with path.open() as fh:
        header = fh.readline().strip().split(",")
        if header[:3] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise ValueError(f"{path}: not an Azure LLM trace header: {header}")
        for line in fh:
            ts, ctx, gen = line.rstrip("\n").split(",")[:3]
            stamps.append(_parse_stamp(ts))
            inputs.append(float(ctx))
            outputs.append(float(gen))
    t = np.asarray(stamps, dtype=np.float64)
    order = np.argsort(t, kind="stable")
    t = t[order] - t[order][0] if len(t) else t
    duration = float(t[-1]) + 1.0 if len(t) else 0.0
    return Trace(
        name=path.stem.removeprefix("AzureLLMInferenceTrace_"),
        arrivals_s=t,
        input_size=np.asarray(inputs, dtype=np.float64)[order],
        output_size=np.asarray(outputs, dtype=np.float64)[order],
        duration_s=duration,
    )


def _parse_stamp(ts: str) -> float:
    # "2023-11-16 18:17:03.9799600": seven fractional digits, more than %f takes.
    whole, _, frac = ts.partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def read_servegen_client(path: Path) -> ServeGenClient:
    """One ServeGen ``chunk-<client>-trace.csv`` (no header)."""
    starts: list[float] = []
    rates: list[float] = []
    dists: list[str] = []
    shapes: list[float] = []
    with path.open() as fh:
        for line in fh:
            cols = line.rstrip("\n").split(",")
            if len(cols) < 6:
                continue
            starts.append(float(cols[0]))
            rates.append(float(cols[1]))
            dists.append(cols[3])
            shapes.append(float(cols[4] or 0.0))
    return ServeGenClient(
        name=path.stem.removesuffix("-trace"),
        window_start_s=np.asarray(starts),
        rate_rps=np.asarray(rates),
        dist=tuple(dists),
        shape=np.asarray(shapes),
    )


def read_servegen_model(directory: Path) -> list[ServeGenClient]:
    """Every client of one ServeGen model directory, in client order."""
    files = sorted(directory.glob("chunk-*-trace.csv"), key=lambda p: int(p.stem.split("-")[1]))
    if not files:
        raise FileNotFoundError(f"no chunk-*-trace.csv under {directory}")
    return [read_servegen_client(p) for p in files]


def _unit_mean_gaps(rng: np.random.Generator, dist: str, shape: float, n: int) -> FloatArray:
    """``n`` inter-arrival gaps with mean 1 from the fitted family (exponential if unknown)."""
    if dist == "Gamma" and shape > 0:
        return rng.gamma(shape, 1.0 / shape, n)
    if dist == "Weibull" and shape > 0:
        return rng.weibull(shape, n) / math.gamma(1.0 + 1.0 / shape)
    return rng.exponential(1.0, n)


def servegen_arrivals(
    clients: Sequence[ServeGenClient], rng: np.random.Generator, rate_scale: float = 1.0
) -> FloatArray:
    """Seeded arrival times for the clients together (sorted), each window at its real rate.

    A window's gaps come from its fitted family with the mean set to ``1 / rate``; the
    window's arrivals are the renewal points that fall inside it.
    """
    chunks: list[FloatArray] = []
    for client in clients:
        for k in np.flatnonzero(client.rate_rps > 0):
            rate = float(client.rate_rps[k]) * rate_scale
            expected = rate * SERVEGEN_WINDOW_S
            n = int(expected * 1.5 + 8 * math.sqrt(expected) + 16)
            gaps = _unit_mean_gaps(rng, client.dist[k], float(client.shape[k]), n) / rate
            offsets = np.cumsum(gaps) - gaps[0] * rng.uniform()  # random phase
            while offsets[-1] < SERVEGEN_WINDOW_S:  # heavy tails: draw more
                more = _unit_mean_gaps(rng, client.dist[k], float(client.shape[k]), n) / rate
                offsets = np.concatenate([offsets, offsets[-1] + np.cumsum(more)])
            inside = offsets[(offsets >= 0) & (offsets < SERVEGEN_WINDOW_S)]
            chunks.append(float(client.window_start_s[k]) + inside)
    if not chunks:
        return np.zeros(0)
    out = np.concatenate(chunks)
    out.sort()
    return out


def size_pool(traces_dir: Path | None = None) -> tuple[FloatArray, FloatArray]:
    """(input, output) token pairs to draw ServeGen request sizes from: Azure ``conv``,
    or a fixed (1000, 100) when that file is absent."""
    path = (
        (traces_dir or default_traces_dir()) / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
    )
    if path.exists():
        conv = read_azure(path)
        return conv.input_size, conv.output_size
    return np.asarray([1000.0]), np.asarray([100.0])


def servegen_trace(
    clients: Sequence[ServeGenClient],
    seed: int,
    *,
    mean_rps: float | None = None,
    sizes: tuple[FloatArray, FloatArray] | None = None,
    name: str = "servegen",
) -> Trace:
    """Clients aggregated into one model's trace; ``mean_rps`` rescales the total rate."""
    rng = np.random.default_rng(seed)
    duration = max(c.duration_s for c in clients)
    total_mean = sum(c.mean_rps for c in clients)
    scale = mean_rps / total_mean if mean_rps is not None and total_mean > 0 else 1.0
    arrivals = servegen_arrivals(clients, rng, scale)
    ins, outs = sizes if sizes is not None else (np.asarray([1000.0]), np.asarray([100.0]))
    pick = rng.integers(0, len(ins), len(arrivals))
    return Trace(name, arrivals, ins[pick], outs[pick], duration)


def synthetic(
    seed: int,
    duration_s: float,
    mean_rps: float,
    *,
    diurnal_amplitude: float = 0.5,
    period_s: float = 86_400.0,
    bursts: int = 0,
    burst_factor: float = 5.0,
    burst_s: float = 60.0,
    input_size: float = 1000.0,
    output_size: float = 100.0,
) -> Trace:
    """Poisson arrivals at ``mean * (1 + amplitude * sin(2 pi t / period))`` plus
    ``bursts`` windows of ``burst_s`` at ``burst_factor`` times that rate (seeded)."""
    rng = np.random.default_rng(seed)
    step = 1.0
    t = np.arange(0.0, duration_s, step)
    rate = mean_rps * (1.0 + diurnal_amplitude * np.sin(2 * np.pi * t / period_s))
    for start in rng.uniform(0, max(duration_s - burst_s, 0.0), bursts):
        rate[(t >= start) & (t < start + burst_s)] *= burst_factor
    counts = rng.poisson(np.clip(rate, 0, None) * step)
    arrivals = np.repeat(t, counts) + rng.uniform(0, step, int(counts.sum()))
    arrivals.sort()
    n = len(arrivals)
    return Trace(
        "synthetic",
        arrivals,
        np.full(n, input_size),
        np.full(n, output_size),
        float(duration_s),
    )


def daily_step(
    seed: int,
    days: int = 3,
    *,
    low_rps: float = 1.0,
    high_rps: float = 40.0,
    start_s: float = 9 * 3600.0,
    end_s: float = 17 * 3600.0,
    period_s: float = 86_400.0,
    input_size: float = 0.0,
    output_size: float = 47.5,
) -> Trace:
    """Poisson arrivals at ``low_rps``, stepping to ``high_rps`` from ``start_s`` to
    ``end_s`` of every period (the step ramp of issue 22: x40 at 09:00); the default sizes
    make one request one unit of the bench cost model (0.02 x 47.5 + 0.05)."""
    rng = np.random.default_rng(seed)
    t = np.arange(0.0, days * period_s, 1.0)
    phase = t % period_s
    rate = np.where((phase >= start_s) & (phase < end_s), high_rps, low_rps)
    counts = rng.poisson(rate)
    arrivals = np.repeat(t, counts) + rng.uniform(0, 1.0, int(counts.sum()))
    arrivals.sort()
    n = len(arrivals)
    return Trace("daily-step", arrivals, np.full(n, input_size), np.full(n, output_size),
                 float(days * period_s))  # fmt: skip
