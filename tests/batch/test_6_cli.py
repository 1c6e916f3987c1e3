"""`ember batch ...` and `ember beat` against the live platform."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.batch.conftest import MODEL, BatchPlatform, write_jsonl
from tests.gateway.conftest import X
from tests.jobs.conftest import EMBER


def env(platform: BatchPlatform) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | {
        "EMBER_URL": platform.live.url,
        "EMBER_API_KEY": ADMIN_KEY,
        "EMBER_DATA_DIR": str(platform.settings.data_dir),
        "COLUMNS": "250",
    }


def ember(platform: BatchPlatform, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EMBER, *args], env=env(platform), capture_output=True, text=True, timeout=120
    )


def test_batch_commands(platform: BatchPlatform) -> None:
    uri = write_jsonl(
        platform.root / "cli" / "in.jsonl", [{"id": i, "features": X} for i in range(90)]
    )
    out = (platform.root / "cli" / "out").as_uri()
    done = ember(
        platform,
        "batch",
        "run",
        "--model",
        MODEL,
        "--input",
        uri,
        "--output",
        out,
        "--shard-rows",
        "30",
        "--wait",
    )
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)
    assert run["status"] == "succeeded" and run["progress"]["rows_scored"] == 90
    status = ember(platform, "batch", "status", run["id"])
    assert status.returncode == 0 and json.loads(status.stdout)["id"] == run["id"]
    listed = ember(platform, "batch", "runs", "--json")
    assert run["id"] in {r["id"] for r in json.loads(listed.stdout)}
    none = ember(platform, "batch", "runs", "--schedule", "ghost-schedule", "--json")
    assert none.returncode != 0 and "ghost-schedule" in none.stderr + none.stdout
    bad = ember(
        platform,
        "batch",
        "schedule",
        "cli-bad",
        "--cron",
        "0 2 * *",
        "--model",
        MODEL,
        "--input",
        uri,
        "--output",
        out,
    )
    assert bad.returncode != 0 and "5 fields" in bad.stderr + bad.stdout
    good = ember(
        platform,
        "batch",
        "schedule",
        "cli-good",
        "--cron",
        "0 3 * * *",
        "--timezone",
        "Asia/Tokyo",
        "--model",
        MODEL,
        "--input",
        uri,
        "--output",
        out,
        "--json",
    )
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["timezone"] == "Asia/Tokyo"
    assert ember(platform, "batch", "pause", "cli-good").returncode == 0
    assert ember(platform, "batch", "unschedule", "cli-good").returncode == 0


def test_two_beat_processes_one_leads(platform: BatchPlatform, tmp_path: Path) -> None:
    beat_env = env(platform) | platform.env | {"EMBER_BATCH_BEAT_INTERVAL_S": "0.5"}
    logs = [tmp_path / "beat-1.log", tmp_path / "beat-2.log"]
    procs = [
        subprocess.Popen(
            [EMBER, "beat"], env=beat_env, stdout=log.open("wb"), stderr=subprocess.STDOUT
        )
        for log in logs
    ]
    try:

        def settled() -> bool:
            text = [log.read_text() for log in logs]
            return all("beat leads" in t or "stands by" in t for t in text)

        services.wait_until(settled, 60, "two beats to settle")
        texts = [log.read_text() for log in logs]
        assert sum("beat leads" in t for t in texts) == 1, texts
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(20)
