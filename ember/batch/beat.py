"""``ember beat``: fires due batch schedules.

The schedules live in the registry and are read on every tick, so an API change
(create, pause, resume, delete) applies at the next tick without a restart. Fire times
are computed by croniter in the schedule's own time zone (a 02:30 daily schedule stays at
02:30 local time across DST; a time skipped by a spring-forward fires once at the
jump, and a repeated hour fires once).

**One beat at a time.** Beats take a Redis lock (``SET NX PX``) before each tick, so a
second beat stays idle while the first lives; and each scheduled run has a unique
``fire_key`` (schedule id + fire time) in the registry, so even two beats that both
think they hold the lock cannot start the same run twice.

**Missed runs** (no beat ran at a fire time) follow the schedule's ``catch_up``:
``skip`` runs none of them (only a fire time within two beat intervals counts as on
time), ``latest`` runs the most recent, ``all`` runs each (at most 50).

``Beat.tick(now)`` does one round at the given time, so tests drive the clock.
"""

from __future__ import annotations

import secrets
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, update
from sqlmodel import Session, col, select

from ember.batch.plan import create_run, pump
from ember.batch.schemas import MAX_CATCH_UP_RUNS, BatchSpec, fire_times, next_fire, zone
from ember.config import Settings
from ember.logs import bound, get_logger
from ember.registry.tables import BatchRun, BatchSchedule

log = get_logger(__name__)
LOCK_KEY = "ember:batch:beat-lock"


class Beat:
    def __init__(self, settings: Settings, engine: Engine, celery: Any) -> None:
        self.settings = settings
        self.engine = engine
        self.celery = celery
        self.token = secrets.token_hex(16)
        self.stop = threading.Event()

    def tick(self, now: datetime | None = None) -> list[BatchRun]:
        """Fire every due schedule as of ``now``; returns the runs started."""
        now = now or datetime.now(UTC)
        started: list[BatchRun] = []
        with Session(self.engine) as session:
            due = session.exec(
                select(BatchSchedule).where(
                    col(BatchSchedule.paused).is_(False),
                    col(BatchSchedule.next_fire_at).is_not(None),
                    col(BatchSchedule.next_fire_at) <= now,
                )
            ).all()
        for schedule in due:
            with bound(schedule=schedule.name):
                try:
                    started.extend(self._fire(schedule, now))
                except Exception:  # one broken schedule must not stop the others
                    log.exception("batch schedule could not fire")
        return started

    def _fire(self, schedule: BatchSchedule, now: datetime) -> list[BatchRun]:
        first = _aware(schedule.next_fire_at or now)
        later = fire_times(schedule.cron, schedule.timezone, first, now, 10 * MAX_CATCH_UP_RUNS)
        times = [first, *later]
        grace = timedelta(seconds=2 * self.settings.batch_beat_interval_s)
        if schedule.catch_up == "all":
            chosen = times[-MAX_CATCH_UP_RUNS:]
        elif schedule.catch_up == "latest":
            chosen = times[-1:]
        else:
            chosen = [t for t in times[-1:] if now - t <= grace]
        missed = len(times) - len(chosen)
        # Advance first (conditionally): a beat racing this one fires nothing twice.
        following = next_fire(schedule.cron, schedule.timezone, max(now, times[-1]))
        with Session(self.engine) as session:
            moved = session.execute(
                update(BatchSchedule)
                .where(
                    col(BatchSchedule.id) == schedule.id,
                    col(BatchSchedule.next_fire_at) == schedule.next_fire_at,
                )
                .values(
                    next_fire_at=following,
                    last_fired_at=chosen[-1] if chosen else schedule.last_fired_at,
                )
            )
            session.commit()
        if getattr(moved, "rowcount", 0) != 1:
            return []
        if missed:
            log.warning("batch schedule missed fire times", missed=missed, policy=schedule.catch_up)
        spec = BatchSpec.model_validate(schedule.spec)
        runs = []
        for fire_at in chosen:
            date = fire_at.astimezone(zone(schedule.timezone)).date().isoformat()
            run, new = create_run(
                self.engine, self.settings, schedule.tenant_id, spec, date, schedule, fire_at, False
            )
            if new:
                pump(self.engine, self.celery, run.id or 0)
                runs.append(run)
                log.info("batch schedule fired", run_id=run.uid, fire_at=fire_at.isoformat())
        return runs

    # --- the process ---------------------------------------------------------------------

    def holds_lock(self, redis: Any) -> bool:
        ttl_ms = int(3 * self.settings.batch_beat_interval_s * 1000)
        if redis.set(LOCK_KEY, self.token, nx=True, px=ttl_ms):
            return True
        held = redis.get(LOCK_KEY)
        if held is not None and held.decode() == self.token:
            redis.pexpire(LOCK_KEY, ttl_ms)
            return True
        return False

    def run_forever(self, redis: Any) -> None:
        log.info("beat starting", interval_s=self.settings.batch_beat_interval_s)
        leading: bool | None = None
        while not self.stop.is_set():
            try:
                now_leading = self.holds_lock(redis)
                if now_leading != leading:
                    log.info("beat " + ("leads" if now_leading else "stands by (another leads)"))
                    leading = now_leading
                if leading:
                    self.tick()
            except Exception as exc:  # Redis or the registry is down: try again
                log.warning("beat tick failed", error=f"{type(exc).__name__}: {exc}"[:300])
            self.stop.wait(self.settings.batch_beat_interval_s)
        try:
            if redis.get(LOCK_KEY) == self.token.encode():
                redis.delete(LOCK_KEY)
        except Exception as exc:  # it expires by itself
            log.info("beat lock not released", error=str(exc)[:200])


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def run_beat(settings: Settings, parent_pid: int | None = None) -> None:
    """``ember beat`` in this process until SIGTERM/SIGINT (or, with ``parent_pid``,
    until that process is no longer this one's parent)."""
    import signal

    import redis as redis_lib

    from ember.registry.db import make_engine
    from ember.work.process import wait_for_schema
    from ember.work.queue import broker_url, make_celery

    engine = make_engine(settings.registry_url)
    wait_for_schema(engine)
    beat = Beat(settings, engine, make_celery(settings))
    signal.signal(signal.SIGTERM, lambda *_: beat.stop.set())
    signal.signal(signal.SIGINT, lambda *_: beat.stop.set())
    from ember.work.process import stop_with_parent

    stop_with_parent(parent_pid)
    beat.run_forever(redis_lib.Redis.from_url(broker_url(settings)))


# --- `ember up`: one supervised beat ---------------------------------------------------


def supervise(settings: Settings, redis_url: str) -> Any:
    """``ember up``'s beat, restarted whenever it dies (the worker's supervisor)."""
    import os
    import subprocess
    import sys

    from ember.work.process import Supervisor

    class BeatSupervisor(Supervisor):
        def _spawn(self) -> None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ember", "beat", "--parent-pid", str(os.getpid())],
                env=self.env,
                start_new_session=True,
            )
            self.started = time.monotonic()
            log.info("beat started", pid=self.proc.pid, restarts=self.restarts)

    supervisor = BeatSupervisor(dict(os.environ) | {"EMBER_REDIS_URL": redis_url})
    supervisor.start()
    return supervisor
