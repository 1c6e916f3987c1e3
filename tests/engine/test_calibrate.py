"""Calibration recovers known coefficients from the synthetic engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.config import Settings
from ember.costmodel import CostModel, fit
from ember.domain.spec import VersionSpec
from ember.engine.base import engine_class
from ember.engine.calibrate import calibrate


def test_fit_recovers_exact_coefficients() -> None:
    samples = [(i, o, 0.002 * i + 0.01 * o + 0.05) for i in (1, 50, 100, 400) for o in (0, 10, 64)]
    alpha, beta, gamma = fit(samples)
    assert (
        alpha == pytest.approx(0.002)
        and beta == pytest.approx(0.01)
        and gamma == pytest.approx(0.05)
    )


def test_fit_folds_a_constant_size_into_gamma() -> None:
    alpha, beta, gamma = fit([(256, 0, 0.010), (256, 0, 0.012), (256, 0, 0.011)])
    assert (alpha, beta) == (0.0, 0.0)
    assert gamma == pytest.approx(0.011)


def test_calibration_of_the_synthetic_engine(tmp_path: Path) -> None:
    # Sleeps of tens of milliseconds: scheduler jitter on a loaded 2-core machine (a few ms)
    # stays well inside the 10 % tolerance.
    known = {"alpha": 0.001, "beta": 0.01, "gamma": 0.05}
    spec = VersionSpec(model="syn", version="1", artifact_uri="file:///none", sha256="",
                       engine="synthetic", engine_config=known)  # fmt: skip
    engine = engine_class("synthetic")(spec, Settings(data_dir=tmp_path))
    engine.load()
    model = calibrate(engine, input_sizes=(10, 50, 100), output_sizes=(0, 5, 10),
                      batch_sizes=(1, 4), repeats=3)  # fmt: skip
    assert model.alpha == pytest.approx(known["alpha"], rel=0.1)
    assert model.beta == pytest.approx(known["beta"], rel=0.1)
    assert model.gamma == pytest.approx(known["gamma"], rel=0.1)
    # A batch of 4 pays gamma once: capacity = 4 * (a*50+g) / (g + 4*a*50) = 4*0.1/0.25 = 1.6
    assert model.capacity_units_per_s == pytest.approx(1.6, rel=0.1)
    assert CostModel.from_dict(model.to_dict()) == model
