"""How many threads a replica may use: its cgroup's CPU quota, not the host's vCPUs.

A container limited to 2 CPUs on a 96-core host that starts 96 OpenMP threads spends its
quota on contention. Order: cgroup v2 ``cpu.max``, cgroup v1 CFS quota, CPU affinity.
Set ``OMP_NUM_THREADS`` before torch is imported (``apply_thread_limits``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CpuBudget:
    threads: int
    source: str
    """Where the number came from: cgroup-v2, cgroup-v1, affinity, or override."""


def _own_cgroup_dir(root: Path) -> Path:
    """The process's own cgroup v2 directory (``/proc/self/cgroup`` line ``0::/path``)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = root / line[3:].lstrip("/")
                if (own / "cpu.max").exists():
                    return own
    except OSError:
        pass
    return root


def _quota_v2(root: Path) -> float | None:
    try:
        quota, period = (_own_cgroup_dir(root) / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def _quota_v1(root: Path) -> float | None:
    base = root / "cpu"
    if not base.exists():
        base = root / "cpu,cpuacct"
    try:
        quota = int((base / "cpu.cfs_quota_us").read_text())
        period = int((base / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def cpu_budget(
    cgroup_root: Path = Path("/sys/fs/cgroup"), override: int | None = None
) -> CpuBudget:
    affinity = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    if override:
        return CpuBudget(override, "override")
    for source, quota in (
        ("cgroup-v2", _quota_v2(cgroup_root)),
        ("cgroup-v1", _quota_v1(cgroup_root)),
    ):
        if quota is not None:
            return CpuBudget(max(1, min(affinity, math.ceil(quota))), source)
    return CpuBudget(max(1, affinity), "affinity")


def apply_thread_limits(budget: CpuBudget) -> None:
    """Export the limit for OpenMP/MKL and, if torch is loaded, set its pools."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(budget.threads)
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(budget.threads)
