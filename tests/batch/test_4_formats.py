"""CSV and Parquet inputs; malformed rows land in the rejects file with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.batch.conftest import BUCKET, MODEL, BatchPlatform, read_output, write_jsonl
from tests.gateway.conftest import X


def test_malformed_rows_go_to_rejects(platform: BatchPlatform) -> None:
    rows: list[object] = [{"id": i, "features": X} for i in range(200)]
    rows[3] = "{not json"
    rows[10] = {"id": 10}  # no features
    rows[20] = {"id": 20, "features": [1.0, 2.0]}  # wrong shape
    rows[30] = {"features": X}  # no key
    rows[40] = {"id": 40, "features": ["a"] * 256}
    uri = write_jsonl(platform.root / "rejects" / "in.jsonl", rows)
    out = (platform.root / "rejects" / "out").as_uri()
    started = platform.run(
        spec={
            "model": MODEL,
            "input_uri": uri,
            "output_uri": out,
            "shard_rows": 100,
            "max_error_ratio": 0.05,
        }
    )
    assert started.status_code == 202, started.text
    run = platform.wait_run(started.json()["id"])
    assert run["status"] == "succeeded", run
    assert run["progress"]["rows_scored"] == 195 and run["progress"]["rows_rejected"] == 5
    assert sorted(r["id"] for r in read_output(run)) == sorted(
        set(range(200)) - {3, 10, 20, 30, 40}
    )
    root = Path(run["output_uri"].removeprefix("file://"))
    rejects = [
        json.loads(line)
        for part in sorted((root / "rejects").glob("*.jsonl"))
        for line in part.read_text().splitlines()
    ]
    reasons = {r["row"]: r["reason"] for r in rejects}
    assert set(reasons) == {3, 10, 20, 30, 40}
    assert "not JSON" in reasons[3]
    assert "no 'features' column" in reasons[10]
    assert "shape" in reasons[20]
    assert "missing key column" in reasons[30]
    assert "numeric" in reasons[40]


def test_too_many_rejects_fail_the_run_with_the_reason(platform: BatchPlatform) -> None:
    rows = [{"id": i, "features": X if i % 2 else [0.0]} for i in range(50)]
    uri = write_jsonl(platform.root / "bad" / "in.jsonl", rows)
    started = platform.run(
        spec={"model": MODEL, "input_uri": uri, "output_uri": (platform.root / "bad").as_uri()}
    )
    assert started.status_code == 202, started.text
    run = platform.wait_run(started.json()["id"])
    assert run["status"] == "failed"
    assert "25 of 50 rows rejected" in run["error"]
    assert run["shard_errors"][0]["shard"] == 0


def test_csv_and_parquet_inputs(platform: BatchPlatform) -> None:
    folder = platform.root / "mixed"
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["user,region,features"] + [f'u{i},eu,"{json.dumps(X)}"' for i in range(60)]
    (folder / "a.csv").write_text("\n".join(lines) + "\n")
    table = pa.table(
        {"user": [f"p{i}" for i in range(70)], "region": ["us"] * 70, "features": [X] * 70}
    )
    pq.write_table(table, folder / "b.parquet")
    started = platform.run(
        spec={
            "model": MODEL,
            "input_uri": "file://" + str(folder / "*"),
            "output_uri": (folder / "out").as_uri(),
            "key_columns": ["user", "region"],
            "shard_rows": 25,
        }
    )
    assert started.status_code == 202, started.text
    assert started.json()["progress"]["shards_total"] == 3 + 3
    run = platform.wait_run(started.json()["id"])
    assert run["status"] == "succeeded", run
    output = read_output(run)
    assert sorted((r["user"], r["region"]) for r in output) == sorted(
        [(f"u{i}", "eu") for i in range(60)] + [(f"p{i}", "us") for i in range(70)]
    )


def test_s3_input_and_output(platform: BatchPlatform) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=platform.settings.s3_endpoint_url, region_name="us-east-1")
    for day, ids in (("2026-02-01", range(0, 50)), ("2026-02-01", range(50, 80))):
        body = "".join(json.dumps({"id": i, "features": X}) + "\n" for i in ids)
        s3.put_object(Bucket=BUCKET, Key=f"users/{day}/part-{ids.start}.jsonl", Body=body.encode())
    started = platform.run(
        spec={
            "model": MODEL,
            "input_uri": f"s3://{BUCKET}/users/{{date}}/part-*.jsonl",
            "output_uri": f"s3://{BUCKET}/scores/{{date}}",
            "shard_rows": 40,
        },
        date="2026-02-01",
    )
    assert started.status_code == 202, started.text
    run = platform.wait_run(started.json()["id"])
    assert run["status"] == "succeeded", run
    assert run["output_uri"].startswith(f"s3://{BUCKET}/scores/2026-02-01/br_")
    prefix = run["output_uri"].removeprefix(f"s3://{BUCKET}/")
    manifest = json.loads(
        s3.get_object(Bucket=BUCKET, Key=f"{prefix}/_manifest.json")["Body"].read()
    )
    ids: list[int] = []
    for part in manifest["parts"]:
        key = part["output_uri"].removeprefix(f"s3://{BUCKET}/")
        data = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        ids.extend(r["id"] for r in pq.read_table(pa.BufferReader(data)).to_pylist())
    assert sorted(ids) == list(range(80))


def test_deadline_fails_the_run(platform: BatchPlatform) -> None:
    uri = write_jsonl(platform.root / "late" / "in.jsonl", [{"id": 1, "features": X}])
    started = platform.run(
        spec={
            "model": MODEL,
            "input_uri": uri,
            "output_uri": (platform.root / "late").as_uri(),
            "deadline_s": 0.001,
        }
    )
    assert started.status_code == 202, started.text
    run = platform.wait_run(started.json()["id"])
    assert run["status"] == "failed" and "deadline" in run["error"]
