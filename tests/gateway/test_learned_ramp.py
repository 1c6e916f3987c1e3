"""A learned ramp on a real platform (API, controller, `ember engine` replicas, Redis),
with a day compressed to 60 s (``EMBER_SCALE_PROFILE_PERIOD_S``): demand steps up at the
same time each "day"; from the second day the second replica is serving *before* the step
arrives (and was not before: one replica served since the last step), and again on the
third day after the API restarted in between (the forecaster's state saved to Redis and
restored)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import ADMIN_KEY

from .conftest import Live, X, live_api

DAY_S = 60.0
STEP_AT, STEP_S = 36.0, 20.0
"""The step: phase 36-56 s of each day (a step on a profile bin's edge, as a step on the
hour is), 8 req/s (one model unit each, uncalibrated, and
``max_batch_size`` 4: a replica covers 4 u/s, 2.8 at the default target utilization, so
more than the two replicas the deployment may have), otherwise one request every 10 s
(one replica, however the step moved the demand's level)."""
LOW_EVERY_S, HIGH_EVERY_S = 10.0, 1.0 / 8.0

pytestmark = pytest.mark.slow


def phase(t: float | None = None) -> float:
    return (time.time() if t is None else t) % DAY_S


def sleep_until(at: float) -> None:
    time.sleep(max(0.0, at - time.time()))


def next_phase(p: float, *, after: float | None = None) -> float:
    """The next wall-clock time at phase ``p`` of a day, after ``after`` (default now)."""
    now = time.time() if after is None else after
    at = now - phase(now) + p
    return at if at > now else at + DAY_S


@contextmanager
def load(live: Live) -> Iterator[list[tuple[float, int]]]:
    """Requests at the day's rate until the block ends; yields (time, status) of each."""
    sent: list[tuple[float, int]] = []
    stop = threading.Event()

    def run() -> None:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(base_url=live.url, headers=headers, timeout=30) as client:
            while not stop.is_set():
                t = time.time()
                body = {"instances": [X]}
                status = client.post("/v1/models/mlp:predict", json=body).status_code
                sent.append((t, status))
                high = STEP_AT <= phase(t) < STEP_AT + STEP_S
                wait = HIGH_EVERY_S if high else LOW_EVERY_S
                if not high:  # ... but never past the step's start
                    wait = min(wait, max(0.05, next_phase(STEP_AT, after=t) - t))
                stop.wait(max(0.0, t + wait - time.time()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield sent
    finally:
        stop.set()
        thread.join(timeout=60)


def hot(live: Live) -> int:
    return sum(1 for r in live.replicas("mlp") if r["state"] == "ready" and r["tier"] == "hot")


@contextmanager
def watch(live: Live) -> Iterator[list[tuple[float, int]]]:
    """Hot replicas, sampled every 0.2 s until the block ends: (time, count)."""
    seen: list[tuple[float, int]] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(0.2):
            t = time.time()
            seen.append((t, hot(live)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(timeout=30)


def two_hot_at(live: Live, since: float) -> float | None:
    """When the deployment first had two hot replicas after ``since``, from the
    controller's own events (their times are when each change happened, not when a
    sampler on a loaded machine saw it)."""
    events = sorted(live.events("mlp"), key=lambda e: e["at"])
    spare = {e["replica_id"] for e in events if e["event"] == "starting" and e.get("then_tier")}
    hot: set[str] = set()
    for e in events:
        rid, kind = e["replica_id"], e["event"]
        if (kind == "ready" and rid not in spare) or (kind == "tier" and e.get("tier") == "hot"):
            hot.add(rid)
        elif kind in ("tier", "draining", "stopped", "failed", "killed"):
            hot.discard(rid)
        if len(hot) >= 2 and e["at"] >= since:
            return float(e["at"])
    return None


def ahead_of_the_step(live: Live, seen: list[tuple[float, int]], since: float) -> None:
    """Two replicas serve when the next step arrives, and they did not all along: since
    ``since`` one served for a while (at least 5 s), then the second came, before the
    step."""
    step = next_phase(STEP_AT)
    sleep_until(step + 1.0)
    view = live.client.get("/v1/deployments/mlp/autoscaler").text
    counts = [n for t, n in seen if since <= t < step]
    assert [1] * 25 in [counts[i : i + 25] for i in range(len(counts))], (counts, view)
    ready = two_hot_at(live, since)
    assert ready is not None and ready < step, (ready, step, counts, view)


def one_for_a_while(live: Live, what: str, timeout_s: float) -> float:
    """Wait until one replica has served alone for 3 s; returns when that began."""
    began: list[float] = []

    def alone() -> bool:
        if hot(live) != 1 or (len(live.replicas("mlp")) != 1 and not warm_only(live)):
            began.clear()
            return False
        began.append(began[0] if began else time.time())
        return time.time() - began[0] >= 3.0

    live.wait(alone, what, timeout_s)
    return began[0]


def warm_only(live: Live) -> bool:
    """Every replica but the one hot is warm (a stepped-down replica kept loaded)."""
    return sum(1 for r in live.replicas("mlp") if r["tier"] != "warm") == 1


def test_a_learned_ramp_is_served_ahead_before_and_after_an_api_restart(
    data_dir: Path, redis_url: str
) -> None:
    settings = {
        "redis_url": redis_url.rsplit("/", 1)[0] + "/11",
        "standby_replicas": 0,
        "scale_profile_period_s": DAY_S,
    }
    with live_api(data_dir, **settings) as live:
        live.register("mlp", "1")
        body = {"model": "mlp", "version": "1", "min_hot": 1, "max_replicas": 2,
                "max_batch_size": 4}  # fmt: skip
        assert live.client.post("/v1/deployments", json=body).status_code == 201
        live.wait(lambda: hot(live) == 1, "the first replica")
        with load(live) as sent, watch(live) as seen:
            # Day 1: the step comes unannounced (with the first replica serving a while
            # before it); the autoscaler follows it and learns it.
            sleep_until(next_phase(STEP_AT, after=time.time() + 10.0))
            live.wait(lambda: len(live.replicas("mlp")) == 2, "a second replica (reacting)", 40)
            sleep_until(next_phase(STEP_AT + STEP_S))
            since = one_for_a_while(live, "a step down after the step", 30)
            # Day 2: ready before the step arrives.
            ahead_of_the_step(live, seen, since)
            sleep_until(next_phase(0.0))  # the step is over: restart in the quiet
        assert sent and all(status == 200 for _, status in sent)
    # The API restarts (its replicas with it, the shared warm set too); the new
    # controller restores what was learned from Redis.
    with live_api(data_dir, **settings) as live:
        with load(live) as sent, watch(live) as seen:
            since = one_for_a_while(live, "the first replica after the restart", 60)
            ahead_of_the_step(live, seen, since)
        assert sent and all(status == 200 for _, status in sent)
        assert [e for e in live.events("mlp") if e["event"] == "starting"]  # its own replicas
