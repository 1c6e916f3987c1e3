"""The queue's own guarantees, without a platform: priorities through the real broker,
settings that would redeliver a running job, a worker that has no key."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from ember.config import Settings
from ember.jobs.queue import QUEUE, RUN_TASK, Publisher
from tests.jobs.conftest import EMBER


def test_higher_priority_jobs_are_delivered_first(tmp_path: Path, redis_url: str) -> None:
    settings = Settings(data_dir=tmp_path, redis_url=redis_url.rsplit("/", 1)[0] + "/7")
    publisher = Publisher(settings)
    order = [(f"job-p{p}", p) for p in (1, 9, 5, 0, 7, 5)]
    try:
        for uid, priority in order:
            assert publisher.run(uid, priority)
        delivered = []
        with publisher.celery.connection_for_read() as conn:
            queue = conn.SimpleQueue(QUEUE)
            for _ in order:
                message = queue.get(timeout=5)
                assert message.headers["task"] == RUN_TASK
                delivered.append(message.payload[0][0])
                message.ack()
            queue.close()
    finally:
        publisher.close()
    # 9 first, then 7, 5 (in publish order), 1, 0.
    assert delivered == ["job-p9", "job-p7", "job-p5", "job-p5", "job-p1", "job-p0"]


def test_visibility_timeout_must_exceed_the_longest_attempt(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="VISIBILITY_TIMEOUT"):
        Settings(data_dir=tmp_path, jobs_timeout_s=600, jobs_visibility_timeout_s=600)
    Settings(data_dir=tmp_path, jobs_timeout_s=600, jobs_visibility_timeout_s=601)


def test_a_worker_without_a_key_refuses_to_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env["EMBER_DATA_DIR"] = str(tmp_path)
    done = subprocess.run([EMBER, "worker"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "EMBER_JOBS_API_KEY" in done.stderr, done.stderr
