"""Thread budget follows the cgroup CPU quota, never the host's CPU count."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ember.engine.threads import apply_thread_limits, cpu_budget

AFFINITY = len(os.sched_getaffinity(0))


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs -> 2 threads (ceil)
    budget = cpu_budget(tmp_path)
    assert budget.source == "cgroup-v2"
    assert budget.threads == min(AFFINITY, 2)


def test_cgroup_v2_quota_of_one_cpu(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert cpu_budget(tmp_path).threads == 1


def test_cgroup_v2_unlimited_falls_back_to_affinity(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_budget(tmp_path) == type(cpu_budget(tmp_path))(AFFINITY, "affinity")


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")  # half a CPU -> 1 thread
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    budget = cpu_budget(tmp_path)
    assert (budget.threads, budget.source) == (1, "cgroup-v1")


def test_cgroup_v1_unlimited(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_budget(tmp_path).source == "affinity"


def test_quota_above_affinity_is_capped(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text(f"{(AFFINITY + 8) * 100000} 100000\n")
    assert cpu_budget(tmp_path).threads == AFFINITY


def test_apply_sets_openmp_and_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    before = torch.get_num_threads()
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    try:
        apply_thread_limits(cpu_budget(tmp_path))
        assert os.environ["OMP_NUM_THREADS"] == "1"
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
