"""Runs every infrastructure check (infra/check.sh): terraform fmt/validate/test,
checkov, the Kubernetes manifests, and a real apply/destroy against moto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "infra" / "check.sh"


@pytest.mark.infra
@pytest.mark.timeout(1800)
def test_infra_checks_pass() -> None:
    # First run installs .venv-infra (~2 min); later runs take ~5 min, mostly the
    # provider's own waiters during the moto apply/destroy.
    proc = subprocess.run(
        ["bash", str(CHECK)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1750,
        check=False,
    )
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout)
    assert proc.returncode == 0, f"infra/check.sh exited {proc.returncode}; its output is above"
