"""The queue's own guarantees, without a platform: priorities through the real broker,
settings that would redeliver a running job, a worker that has no key."""

from __future__ import annotations

import gc
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


def test_a_warmed_publisher_leaves_the_broker_usable_for_the_next_one(
    tmp_path: Path, redis_url: str
) -> None:
    """``warm`` connects ahead on a connection of its own: closing that publisher (which
    force-closes kombu's process-wide pool for its broker URL) must not leave the next
    publisher on the same Redis database an "Acquire on closed pool" (a pooled warm-up
    did). A broker that is down is only logged."""
    settings = Settings(data_dir=tmp_path, redis_url=redis_url.rsplit("/", 1)[0] + "/8")
    first = Publisher(settings)
    first.warm().join(10)
    first.close()
    second = Publisher(settings)
    try:
        assert second.run("job-after-warm", 5)
    finally:
        second.close()
    down = Publisher(Settings(data_dir=tmp_path, redis_url="redis://127.0.0.1:1/0"))
    thread = down.warm()
    thread.join(15)
    assert not thread.is_alive()
    down.close()


def test_a_worker_freezes_its_start_up_objects_once_celery_is_ready() -> None:
    from celery.signals import worker_ready

    from ember.jobs.worker import _freeze_when_ready

    gc.unfreeze()
    receiver = _freeze_when_ready()
    try:
        assert gc.get_freeze_count() == 0
        worker_ready.send(sender=None)
        assert gc.get_freeze_count() > 0
    finally:
        worker_ready.disconnect(receiver)
        gc.unfreeze()
