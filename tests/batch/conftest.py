"""A live platform for the batch regime: the API with a replica of the slow MLP example
(versions 1 and 2), a real Redis and two real `ember worker` processes; built from the
async regime's fixtures (tests/jobs/conftest.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from tests import services
from tests.jobs.conftest import Platform, live_platform

MODEL = "scorer"
DELAY_S = 0.02
BATCH = {
    "batch_lease_s": 2.0,
    "batch_sweep_interval_s": 0.5,
    "batch_beat_interval_s": 1.0,
}


class BatchPlatform(Platform):
    @property
    def root(self) -> Path:
        """Where a tenant's (here: the admin's) batch data lives, in the object store."""
        path = self.settings.data_dir / "objects" / "batch" / "default"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def run(self, **spec: Any) -> httpx.Response:
        return self.client.post("/v1/batch/runs", json=spec)

    def get_run(self, run_id: str) -> dict[str, Any]:
        response = self.client.get(f"/v1/batch/runs/{run_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def wait_run(self, run_id: str, timeout_s: float = 120) -> dict[str, Any]:
        last: dict[str, Any] = {}

        def done() -> bool:
            nonlocal last
            last = self.get_run(run_id)
            return last["status"] in ("succeeded", "failed")

        try:
            services.wait_until(done, timeout_s, f"batch run {run_id}")
        except RuntimeError as exc:
            raise AssertionError(f"{exc}: {last}\n{self.worker_logs()}") from exc
        return last


def write_jsonl(path: Path, rows: list[Any]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path.as_uri()


def read_output(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Every output row of a run, read through its manifest."""
    root = Path(run["output_uri"].removeprefix("file://"))
    manifest = json.loads((root / "_manifest.json").read_text())
    rows: list[dict[str, Any]] = []
    for part in manifest["parts"]:
        rows.extend(pq.read_table(part["output_uri"].removeprefix("file://")).to_pylist())
    return rows


BUCKET = "batch-data"


@pytest.fixture(scope="package")
def platform(
    tmp_path_factory: pytest.TempPathFactory, moto_endpoint: str
) -> Iterator[BatchPlatform]:
    import boto3

    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=BUCKET
    )
    tmp = tmp_path_factory.mktemp("batch")
    env = {f"EMBER_{k.upper()}": str(v) for k, v in BATCH.items()}
    env |= {"EMBER_S3_ENDPOINT_URL": moto_endpoint, "EMBER_S3_ALLOWED_BUCKETS": BUCKET}
    env |= {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    s3 = {"s3_endpoint_url": moto_endpoint, "s3_allowed_buckets": [BUCKET]}
    with live_platform(
        BatchPlatform,
        tmp,
        MODEL,
        DELAY_S,
        max_batch_size=64,
        settings_extra=BATCH | s3,
        env_extra=env,
    ) as platform:
        yield platform
