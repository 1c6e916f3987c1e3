"""Hostile input: precise problem+json, never a 500."""

from __future__ import annotations

from typing import Any

import pytest

from tests.batch.conftest import MODEL, BatchPlatform, write_jsonl
from tests.gateway.conftest import X


def schedule(platform: BatchPlatform, **extra: Any) -> dict[str, Any]:
    return {
        "name": "nightly",
        "cron": "0 2 * * *",
        "timezone": "Europe/Paris",
        "model": MODEL,
        "input_uri": "file://" + str(platform.root / "in" / "{date}.jsonl"),
        "output_uri": (platform.root / "out").as_uri(),
    } | extra


@pytest.mark.parametrize(
    ("extra", "status", "needle"),
    [
        ({"cron": "0 25 * * *"}, 422, "invalid cron expression"),
        ({"cron": "0 2 * *"}, 422, "5 fields"),
        ({"timezone": "Europe/Atlantis"}, 422, "unknown IANA time zone"),
        ({"model": "nope"}, 404, "nope"),
        ({"model": f"{MODEL}:9"}, 404, "no version or alias"),
        ({"input_uri": "http://example.com/x.csv"}, 422, "file:// or s3://"),
        ({"output_uri": "file:///etc/ember"}, 422, "outside the allowed file roots"),
        ({"shard_rows": 0}, 422, "shard_rows"),
        ({"catch_up": "sometimes"}, 422, "catch_up"),
        ({"key_columns": ["version"]}, 422, "output columns"),
        ({"name": "Bad Name"}, 422, "name"),
    ],
)
def test_bad_schedules(
    platform: BatchPlatform, extra: dict[str, Any], status: int, needle: str
) -> None:
    response = platform.client.post("/v1/batch/schedules", json=schedule(platform, **extra))
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert needle in response.text


def test_schedule_lifecycle(platform: BatchPlatform) -> None:
    created = platform.client.post("/v1/batch/schedules", json=schedule(platform, name="life"))
    assert created.status_code == 201, created.text
    assert created.json()["next_fire_at"] is not None
    again = platform.client.post("/v1/batch/schedules", json=schedule(platform, name="life"))
    assert again.status_code == 409
    assert platform.client.post("/v1/batch/schedules/life/pause").json()["paused"] is True
    assert platform.client.post("/v1/batch/schedules/life/resume").json()["paused"] is False
    names = [s["name"] for s in platform.client.get("/v1/batch/schedules").json()["items"]]
    assert "life" in names
    assert platform.client.delete("/v1/batch/schedules/life").status_code == 204
    assert platform.client.get("/v1/batch/schedules/life").status_code == 404


def test_unreadable_inputs(platform: BatchPlatform) -> None:
    out = (platform.root / "out").as_uri()
    missing = platform.run(
        spec={
            "model": MODEL,
            "input_uri": (platform.root / "nothing.jsonl").as_uri(),
            "output_uri": out,
        }
    )
    assert missing.status_code == 422, missing.text
    assert "no object at" in missing.json()["detail"]
    glob = platform.run(
        spec={
            "model": MODEL,
            "input_uri": "file://" + str(platform.root / "none" / "*.jsonl"),
            "output_uri": out,
        }
    )
    assert glob.status_code == 422 and "no input file matches" in glob.json()["detail"]
    (platform.root / "junk.parquet").write_bytes(b"not parquet at all")
    junk = platform.run(
        spec={
            "model": MODEL,
            "input_uri": (platform.root / "junk.parquet").as_uri(),
            "output_uri": out,
        }
    )
    assert junk.status_code == 422 and "not a readable Parquet" in junk.json()["detail"]
    odd = write_jsonl(platform.root / "data.txt", [{"id": 1, "features": X}])
    unknown = platform.run(spec={"model": MODEL, "input_uri": odd, "output_uri": out})
    assert unknown.status_code == 422 and "set `format`" in unknown.json()["detail"]
    both = platform.run(schedule="x", spec={"model": MODEL, "input_uri": odd, "output_uri": out})
    assert both.status_code == 422 and "exactly one" in both.json()["detail"]
    assert platform.run(schedule="ghost").status_code == 404
    assert platform.client.get("/v1/batch/runs/br_" + "0" * 24).status_code == 404
    assert platform.client.get("/v1/batch/runs/nope").status_code == 422
    garbage = platform.client.post(
        "/v1/batch/runs", content=b"{", headers={"content-type": "application/json"}
    )
    assert 400 <= garbage.status_code < 500


def test_tenant_keys_are_confined_to_their_prefix(platform: BatchPlatform) -> None:
    key = platform.client.post("/v1/keys", json={"name": "batch-tenant-key"})
    assert key.status_code == 201, key.text
    headers = {"Authorization": f"Bearer {key.json()['key']}"}
    outside = schedule(platform, name="sneaky", output_uri=platform.root.parent.as_uri())
    refused = platform.client.post("/v1/batch/schedules", json=outside, headers=headers)
    assert refused.status_code == 422, refused.text
    assert "output_uri must lie under" in refused.json()["detail"]
    inside = platform.client.post(
        "/v1/batch/schedules", json=schedule(platform, name="own"), headers=headers
    )
    assert inside.status_code == 201, inside.text
