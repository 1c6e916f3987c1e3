"""Runs over real files, scored by real workers through the gateway."""

from __future__ import annotations

from collections import Counter

from tests.batch.conftest import MODEL, BatchPlatform, read_output, write_jsonl
from tests.gateway.conftest import X


def test_run_scores_every_row_once_with_version_columns(platform: BatchPlatform) -> None:
    rows = [{"id": i, "features": X} for i in range(3000)]
    uri = write_jsonl(platform.root / "users" / "2026-01-02" / "part-a.jsonl", rows[:1700])
    write_jsonl(platform.root / "users" / "2026-01-02" / "part-b.jsonl", rows[1700:])
    out = (platform.root / "out").as_uri()
    started = platform.run(
        spec={
            "model": MODEL,
            "input_uri": uri.replace("2026-01-02/part-a", "{date}/part-*"),
            "output_uri": out,
            "shard_rows": 500,
            "max_parallel_shards": 3,
        },
        date="2026-01-02",
    )
    assert started.status_code == 202, started.text
    body = started.json()
    assert body["version"] == "1"
    assert body["progress"]["shards_total"] == 7  # 1700 → 4 shards, 1300 → 3
    assert body["progress"]["rows_total"] == 3000
    run = platform.wait_run(body["id"])
    assert run["status"] == "succeeded", run
    progress = run["progress"]
    assert progress["shards_done"] == 7 and progress["rows_scored"] == 3000
    assert progress["rows_per_s"] > 0 and progress["eta_s"] == 0
    output = read_output(run)
    assert Counter(r["id"] for r in output) == Counter(range(3000))
    assert {r["model"] for r in output} == {MODEL}
    assert {r["version"] for r in output} == {"1"}
    sha = platform.client.get(f"/v1/models/{MODEL}/versions/1").json()["sha256"]
    assert {r["artifact_sha256"] for r in output} == {sha}
    assert all(len(r["prediction"]) > 0 and r["scored_at"] is not None for r in output)
