"""The batcher's compute thread: passes run off the event loop, answers come back on it,
and a model that raises anything — even ``SystemExit`` — fails only its own request."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember.config import Settings
from ember.domain.spec import BatchPolicy, Priority, VersionSpec
from ember.engine.base import Engine, Sized
from ember.engine.metrics import EngineMetrics
from ember.engine.scheduler import Scheduler
from ember.errors import DeadlineExceeded, EngineError


class Spinning(Engine):
    """A CPU engine: each pass keeps the CPU busy for ``seconds`` (no sleep: it holds the
    GIL as a Python model would) and answers which thread ran it."""

    name = "spinning"

    def __init__(self, tmp: Path, seconds: float, device: str = "cpu") -> None:
        self.raises: BaseException | None = None
        spec = VersionSpec(model="spin", version="1", artifact_uri="file:///none", sha256="",
                           engine="synthetic")  # fmt: skip
        super().__init__(spec, Settings(data_dir=tmp), device)
        self.seconds = seconds

    def load(self) -> None: ...

    def prepare(self, instance: Any) -> Sized:
        return Sized(instance, 1)

    def forward(self, batch: Sequence[Any]) -> list[Any]:
        if self.raises is not None and any(value == "raise" for value in batch):
            raise self.raises
        until = time.perf_counter() + self.seconds
        while time.perf_counter() < until:
            pass
        return [{"x": value, "thread": threading.get_ident()} for value in batch]

    def probe(self) -> Any:
        return 0


def _scheduler(engine: Engine) -> tuple[Scheduler, EngineMetrics]:
    metrics = EngineMetrics("spin", "1")
    policy = BatchPolicy(max_queue_delay_ms=1, max_batch_size=1)
    return Scheduler(engine, policy, metrics), metrics


def test_passes_run_on_the_compute_thread_and_the_loop_answers_meanwhile(
    tmp_path: Path,
) -> None:
    async def run() -> tuple[list[int], int, dict[str, float], str]:
        scheduler, metrics = _scheduler(Spinning(tmp_path, 0.15))
        scheduler.start()
        timing: dict[str, float] = {}
        try:
            first = await scheduler.submit([0], Priority.online)
            computing = asyncio.create_task(scheduler.submit([1], Priority.online, timing=timing))
            ticks = 0
            while not computing.done():
                await asyncio.sleep(0.005)
                ticks += 1
            second = await computing
        finally:
            await scheduler.stop()
        assert [first[0]["x"], second[0]["x"]] == [0, 1]
        return [first[0]["thread"], second[0]["thread"]], ticks, timing, metrics.render().decode()

    loop_thread = threading.get_ident()  # asyncio.run runs its loop on this thread
    ran, ticks, timing, text = asyncio.run(run())
    assert loop_thread not in ran and ran[0] == ran[1]  # one compute thread, kept
    assert ticks >= 10  # a 150 ms pass: the loop kept running every 5 ms or so
    assert timing["forward_s"] >= 0.15 and 0 <= timing["handoff_s"] < timing["forward_s"]
    assert 'ember_forward_passes_total{model="spin",version="1"} 2.0' in text
    assert (
        'ember_request_latency_seconds_count{model="spin",priority="online",version="1"} 2.0'
        in text
    )


def test_a_model_that_raises_even_system_exit_fails_only_its_request(tmp_path: Path) -> None:
    async def run(raises: BaseException) -> tuple[str, Any]:
        engine = Spinning(tmp_path, 0.001)
        engine.raises = raises
        scheduler, _ = _scheduler(engine)
        scheduler.start()
        try:
            try:
                await scheduler.submit(["raise"], Priority.online, timeout_ms=5000)
                failed = "answered"
            except EngineError as exc:
                failed = exc.detail
            after = await scheduler.submit([7], Priority.online, timeout_ms=5000)
        finally:
            await scheduler.stop()
        return failed, after[0]["x"]

    assert asyncio.run(run(ValueError("bad"))) == ("inference failed: ValueError: bad", 7)
    failed, after = asyncio.run(run(SystemExit(3)))
    assert "SystemExit" in failed and after == 7


def test_a_deadline_ends_the_wait_for_an_answer(tmp_path: Path) -> None:
    async def expire() -> tuple[str, int]:
        scheduler, _ = _scheduler(Spinning(tmp_path, 0.002))
        # no batcher started: the request waits in its queue until its deadline
        try:
            await scheduler.submit([0], Priority.online, timeout_ms=20)
        except DeadlineExceeded:
            return "DeadlineExceeded", scheduler.queued
        return "answered", scheduler.queued

    assert asyncio.run(expire()) == ("DeadlineExceeded", 1)  # dropped at the next batch
