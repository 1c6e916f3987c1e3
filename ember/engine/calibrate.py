"""Calibration: measure a loaded engine, fit ``cost = alpha*in + beta*out + gamma``.

One model unit is one second of this replica's time at batch size 1. Requests over a
grid of input (and output) sizes at batch 1 give alpha, beta, gamma; full batches of a
mid-sized input give the capacity in units per second (how much batching buys).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from ember.costmodel import CostModel, fit
from ember.engine.base import Engine
from ember.logs import get_logger

log = get_logger(__name__)
INPUT_SIZES = (8, 32, 128, 256)
OUTPUT_SIZES = (0,)
BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def _timed(engine: Engine, batch: list[object], repeats: int) -> float:
    values = [engine.prepare(x).value for x in batch]
    engine.forward(values)  # warm-up: first calls pay for allocation and kernel selection
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.forward(values)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def calibrate(
    engine: Engine,
    input_sizes: Sequence[int] = INPUT_SIZES,
    output_sizes: Sequence[int] = OUTPUT_SIZES,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    repeats: int = 5,
) -> CostModel:
    samples: list[tuple[float, float, float]] = []
    for n_in in input_sizes:
        for n_out in output_sizes:
            instance = engine.sample(n_in, n_out)
            sized = engine.prepare(instance)
            seconds = _timed(engine, [instance], repeats)
            samples.append((sized.input_size, sized.output_size, seconds))
    alpha, beta, gamma = fit(samples)
    unit = CostModel(alpha, beta, gamma)
    mid = engine.sample(input_sizes[len(input_sizes) // 2], output_sizes[0])
    mid_sized = engine.prepare(mid)
    per_instance = unit.cost(mid_sized.input_size, mid_sized.output_size)
    capacity = max(b * per_instance / _timed(engine, [mid] * b, repeats) for b in batch_sizes)
    model = CostModel(alpha, beta, gamma, capacity)
    log.info("calibrated", alpha=alpha, beta=beta, gamma=gamma, capacity_units_per_s=capacity,
             samples=len(samples))  # fmt: skip
    return model
