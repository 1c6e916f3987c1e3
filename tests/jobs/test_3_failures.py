"""Failures that must lose nothing: a worker SIGKILLed mid-job, Redis restarted (without
persistence, so every message is gone) while jobs run and while new ones arrive."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from tests.jobs.conftest import FINISHED, Platform, X

Y = [0.1] * 256


def test_sigkill_mid_job_completes_after_redelivery_and_writes_once(platform: Platform) -> None:
    expected = platform.online(1)[0]
    replacements: list[threading.Thread] = []
    for round_ in range(3):
        job_id = platform.submit([X] * 12).json()["id"]  # 6 chunks of 2
        running = platform.wait(
            job_id,
            lambda j: (
                j["status"] == "running"
                and j["version"] is not None
                and j["attempts"][-1]["outcome"] == "running"
            ),
        )
        holder = running["attempts"][-1]["worker"]
        victim = next(w for w in platform.workers if w.pid == int(holder.rsplit(":", 1)[1]))
        platform.kill(victim)
        # A replacement starts meanwhile; the job is taken over by whichever worker is up.
        replacements.append(threading.Thread(target=platform.start_worker))
        replacements[-1].start()

        done = platform.wait(job_id)
        assert done["status"] == "succeeded", (round_, done, platform.worker_logs())
        attempts = done["attempts"]
        outcomes = [a["outcome"] for a in attempts]
        assert outcomes.count("succeeded") == 1, outcomes
        lost = [a for a in attempts if a["outcome"] == "lost"]
        assert [a["worker"] for a in lost] == [holder], attempts
        assert "lease" in (lost[0]["error"] or "")
        winner = next(a for a in attempts if a["outcome"] == "succeeded")
        assert winner["worker"] != holder and winner["number"] > lost[0]["number"]

        # Written once: the job's result is the winning attempt's object, whole and intact.
        result = Path(done["result_uri"].removeprefix("file://"))
        assert result.name == f"attempt-{winner['number']}.json"
        objects = sorted(p.name for p in result.parent.iterdir())
        assert objects == [result.name], objects
        predictions = platform.client.get(f"/v1/jobs/{job_id}/result").json()["predictions"]
        assert len(predictions) == 12
        assert np.allclose(predictions, [expected] * 12, rtol=1e-4, atol=1e-6)
    for thread in replacements:
        thread.join()
    assert len(platform.live_workers()) == 2


def test_redis_restart_mid_run_loses_no_job(platform: Platform) -> None:
    before = [platform.submit([X] * 4).json()["id"] for _ in range(6)]
    platform.wait(before[0], lambda j: j["status"] != "queued")
    platform.redis.kill()  # no persistence: queued messages and unacked ones are gone
    during = [platform.submit([Y]) for _ in range(2)]
    assert [r.status_code for r in during] == [202, 202], [r.text for r in during]
    platform.redis.start()

    ids = before + [r.json()["id"] for r in during]
    jobs = [platform.wait(i, timeout_s=120) for i in ids]
    for job in jobs:
        assert job["status"] in FINISHED
        assert job["status"] == "succeeded" or job["error"], job
    assert all(j["status"] == "succeeded" for j in jobs), [
        (j["id"], j["status"], j["error"]) for j in jobs
    ]
    # Every job ran to the end once, whichever messages were lost.
    for job in jobs:
        assert [a["outcome"] for a in job["attempts"]].count("succeeded") == 1, job["attempts"]
