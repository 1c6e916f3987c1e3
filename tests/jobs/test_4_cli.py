"""`ember jobs ...` against the live platform."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from tests.api.conftest import ADMIN_KEY
from tests.jobs.conftest import EMBER, MODEL, Platform, X


def _env(platform: Platform) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | {
        "EMBER_URL": platform.live.url,
        "EMBER_API_KEY": ADMIN_KEY,
        "EMBER_DATA_DIR": str(platform.settings.data_dir),
        "COLUMNS": "250",
    }


def ember(platform: Platform, *args: str) -> subprocess.CompletedProcess[str]:
    env = _env(platform)
    return subprocess.run([EMBER, *args], env=env, capture_output=True, text=True, timeout=120)


def test_jobs_commands(platform: Platform, tmp_path: Path) -> None:
    done = ember(platform, "jobs", "submit", MODEL, "--instances", json.dumps([X]), "--wait")
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)
    assert job["status"] == "succeeded" and job["version"] == "1"

    # A file over 1 MiB goes through the object store (job-inputs/<tenant>/) as input_uri.
    big = tmp_path / "my inputs?#%.json"  # a name a URI could not carry as it is
    big.write_text(json.dumps({"instances": [X, X]}) + " " * (1024 * 1024 + 1))
    waited = ember(platform, "jobs", "submit", f"{MODEL}:1", "--input", str(big), "--wait")
    assert waited.returncode == 0, waited.stderr
    uploaded = json.loads(waited.stdout)
    assert "/job-inputs/default/" in uploaded["input_uri"] and uploaded["instances"] == 2
    assert uploaded["input_uri"].endswith("-my_inputs___.json")

    out = tmp_path / "result.json"
    fetched = ember(platform, "jobs", "result", uploaded["id"], "-o", str(out))
    assert fetched.returncode == 0, fetched.stderr
    assert hashlib.sha256(out.read_bytes()).hexdigest() == uploaded["result_sha256"]

    listed = ember(platform, "jobs", "list", "--status", "succeeded", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {job["id"], uploaded["id"]} <= {j["id"] for j in json.loads(listed.stdout)}

    slow = platform.submit([X] * 400).json()["id"]  # 200 chunks: surely still unfinished
    assert ember(platform, "jobs", "cancel", slow).returncode == 0
    cancelled = ember(platform, "jobs", "wait", slow)
    assert cancelled.returncode == 1 and "cancelled" in cancelled.stderr


def test_worker_ping_is_a_liveness_check(platform: Platform, tmp_path: Path) -> None:
    """`ember worker --ping` (the worker pod's liveness probe): 0 while a worker of this
    host is alive, 1 where none runs (another temp directory: no liveness file)."""
    alive = subprocess.run([EMBER, "worker", "--ping"], capture_output=True, text=True,
                           timeout=60, env=_env(platform))  # fmt: skip
    assert alive.returncode == 0, alive.stderr
    elsewhere = _env(platform) | {"TMPDIR": str(tmp_path)}
    dead = subprocess.run([EMBER, "worker", "--ping"], capture_output=True, text=True,
                          timeout=60, env=elsewhere)  # fmt: skip
    assert dead.returncode == 1 and "no live worker on this host" in dead.stderr
