"""A killed worker and a promotion in the middle of a run: the run finishes with every
row exactly once, all on the version pinned when it started."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from tests import services
from tests.batch.conftest import MODEL, BatchPlatform, read_output, write_jsonl
from tests.gateway.conftest import X


def start(platform: BatchPlatform, name: str, rows: int, shard_rows: int) -> str:
    uri = write_jsonl(
        platform.root / name / "in.jsonl", [{"id": i, "features": X} for i in range(rows)]
    )
    started = platform.run(
        spec={
            "model": MODEL,
            "input_uri": uri,
            "output_uri": (platform.root / name / "out").as_uri(),
            "shard_rows": shard_rows,
            "max_parallel_shards": 4,
        }
    )
    assert started.status_code == 202, started.text
    return str(started.json()["id"])


def test_killed_worker_run_resumes_without_duplicates_or_gaps(platform: BatchPlatform) -> None:
    run_id = start(platform, "killed", 4000, 100)

    def some_done() -> bool:
        return platform.get_run(run_id)["progress"]["shards_done"] >= 3

    services.wait_until(some_done, 90, "three committed shards")
    victim = platform.live_workers()[0]
    platform.kill(victim)
    run = platform.wait_run(run_id, timeout_s=150)
    assert run["status"] == "succeeded", run
    assert run["progress"]["shards_done"] == 40 and run["progress"]["rows_scored"] == 4000
    assert Counter(r["id"] for r in read_output(run)) == Counter(range(4000))
    platform.start_worker()


def test_promote_during_a_run_does_not_mix_versions(platform: BatchPlatform) -> None:
    run_id = start(platform, "promote", 3000, 100)
    services.wait_until(
        lambda: platform.get_run(run_id)["progress"]["shards_done"] >= 1, 90, "a committed shard"
    )
    promoted = platform.client.post(f"/v1/deployments/{MODEL}:promote", json={"version": "2"})
    assert promoted.status_code == 200, promoted.text
    try:
        _promoted_mid_run(platform, run_id)
    finally:  # the platform is shared: leave version 1 in production for the next file
        back = platform.client.post(f"/v1/deployments/{MODEL}:promote", json={"version": "1"})
        assert back.status_code == 200, back.text


def _promoted_mid_run(platform: BatchPlatform, run_id: str) -> None:
    run = platform.wait_run(run_id, timeout_s=150)
    # The run was pinned to version 1 when it started: the pools controller keeps version 1
    # served (a hot replica) until the run ends, and every row is version 1.
    assert run["version"] == "1"
    assert run["status"] == "succeeded", run
    parts = sorted(Path(run["output_uri"].removeprefix("file://")).glob("part-*.parquet"))
    written = [row for part in parts for row in pq.read_table(part).to_pylist()]
    assert written and {r["version"] for r in written} == {"1"}
    assert Counter(r["id"] for r in read_output(run)) == Counter(range(3000))
    later = start(platform, "promote-later", 10, 10)
    assert platform.get_run(later)["version"] == "2"
    done = platform.wait_run(later)
    assert done["status"] == "succeeded", done
    assert {r["version"] for r in read_output(done)} == {"2"}
