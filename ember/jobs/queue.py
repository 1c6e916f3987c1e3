"""How jobs are published to the Celery queue (``ember.work.queue``).

Messages carry only a job id; everything else is read from the registry when the job
runs, so a duplicate or stale message is harmless (the claim refuses it). Tasks are
acknowledged late and rejected on worker loss, and the visibility timeout is set above
the longest attempt (``EMBER_JOBS_TIMEOUT_S``), so an unacknowledged message comes back
only once its attempt can no longer be running.

Priorities: a job's ``priority`` is 0-9, higher first. kombu's Redis transport serves
its priority 0 first, so the message priority is ``9 - priority``.
"""

from __future__ import annotations

import threading
import time

from ember import tracing
from ember.config import Settings
from ember.logs import get_logger
from ember.work.queue import QUEUE, make_celery

log = get_logger(__name__)

RUN_TASK = "ember.jobs.run"
WEBHOOK_TASK = "ember.jobs.webhook"
EPOCH_KEY = "ember:jobs:epoch"
"""Set by the sweeper; its absence means Redis lost its data (restart without
persistence, failover, flush): every queued job is then published again."""
SWEEP_LOCK = "ember:jobs:sweep-lock"


class Publisher:
    """Publishes job and webhook messages from the API (or a worker).

    A failure is logged and reported, never raised: the job row is already committed
    with ``published_at`` unset, and the sweeper publishes it once Redis answers. After a
    failure, publishing pauses for ``pause_s`` so a Redis outage does not add a connect
    timeout to every submission.
    """

    def __init__(self, settings: Settings, pause_s: float = 5.0) -> None:
        self.celery = make_celery(settings)
        self.pause_s = pause_s
        self._down_until = 0.0
        self._lock = threading.Lock()

    def run(self, uid: str, priority: int, countdown_s: float = 0.0) -> bool:
        return self._send(RUN_TASK, uid, priority=9 - priority, countdown_s=countdown_s)

    def webhook(self, uid: str, countdown_s: float = 0.0) -> bool:
        return self._send(WEBHOOK_TASK, uid, priority=0, countdown_s=countdown_s)

    def _send(self, task: str, uid: str, *, priority: int, countdown_s: float) -> bool:
        if time.monotonic() < self._down_until:
            return False
        try:
            self.celery.send_task(
                task,
                args=[uid],
                queue=QUEUE,
                priority=priority,
                countdown=countdown_s if countdown_s > 0 else None,
                retry=False,
                headers=tracing.carrier(),  # the job's trace, which the worker continues
            )
        except Exception as exc:  # kombu OperationalError, redis errors, socket errors
            with self._lock:
                self._down_until = time.monotonic() + self.pause_s
            log.warning(
                "job not published (the sweeper will publish it)",
                job_id=uid,
                task=task,
                error=f"{type(exc).__name__}: {exc}"[:300],
            )
            return False
        return True

    def warm(self) -> threading.Thread:
        """Load the broker's transport and Celery's routing ahead, in a thread: the first
        publish did it, 0.6 s of the first batch run's clock in a busy API process (83 ms
        alone, 56 ms after this). A broker that is down is left to ``_send``."""

        def connect() -> None:
            try:  # a connection of its own: kombu's pools are per broker URL, process-wide
                with self.celery.connection_for_write() as connection:
                    connection.ensure_connection(max_retries=1)
                    _ = connection.default_channel
                _ = self.celery.amqp.router, self.celery.amqp.queues
            except Exception as exc:  # Redis down at start: the first publish says so
                log.info("broker not reached ahead", error=f"{type(exc).__name__}: {exc}"[:300])

        thread = threading.Thread(target=connect, name="ember-publisher-warm", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        pool = self.celery.pool if self.celery._pool is not None else None
        if pool is not None:
            pool.force_close_all()
