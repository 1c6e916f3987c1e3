"""``ember worker``: a Celery worker for jobs; and the worker ``ember up`` supervises.

One process runs ``EMBER_JOBS_WORKER_CONCURRENCY`` jobs at once on Celery's thread pool
(the work is HTTP calls to the gateway), plus a lease-renewal thread and the sweeper.

**How a worker authenticates.** Workers call the gateway's data plane like any client,
with a *worker* key and ``X-Ember-Tenant: <the job's tenant>`` (a worker key acts for any
tenant on the data plane and nothing on the control plane, ``ember.registry.tenants``),
so one worker serves every tenant and each call is admitted, budgeted and logged as that
tenant. The key is ``EMBER_JOBS_API_KEY``; ``ember up`` mints a dedicated worker key named
``ember-up-worker`` at every start (revoking the previous one) and hands it to its worker
in the environment, so a single-machine set-up needs no configuration. Workers on other
hosts get a key created with ``ember keys create --worker`` (an admin key works too) and
the gateway's URL in ``EMBER_JOBS_API_URL``. Workers also need the
registry (``EMBER_DATABASE_URL``), Redis (``EMBER_REDIS_URL``) and, for large inputs and
results, the object store.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlmodel import Session, col, select

from ember import tracing
from ember.config import SWITCH_INTERVAL_S, Settings
from ember.errors import InvalidInput
from ember.jobs import webhooks
from ember.jobs.queue import RUN_TASK, WEBHOOK_TASK, Publisher
from ember.jobs.runner import Runner
from ember.jobs.schemas import job_document
from ember.jobs.sweeper import Sweeper
from ember.logs import bind_process, get_logger
from ember.registry.db import make_engine
from ember.registry.tables import Job
from ember.work.client import api_url, worker_id
from ember.work.lease import Heartbeat
from ember.work.process import Supervisor, stop_with_parent, wait_for_schema
from ember.work.queue import QUEUE, make_celery

log = get_logger(__name__)
UP_WORKER_KEY = "ember-up-worker"


def build(settings: Settings) -> tuple[Any, Runner, Sweeper, Heartbeat]:
    """The Celery app with Ember's tasks bound to a runner (no threads started)."""
    if settings.jobs_api_key is None:
        raise InvalidInput(
            "a worker needs EMBER_JOBS_API_KEY (a worker key; it acts for each job's tenant). "
            "`ember up` sets one for its own worker; elsewhere create one with "
            "`ember keys create --worker`"
        )
    engine = make_engine(settings.registry_url)
    wait_for_schema(engine)
    celery = make_celery(settings)
    publisher = Publisher(settings)
    leases = Heartbeat(engine, Job, settings.jobs_lease_s, "ember-leases")
    runner = Runner(settings, engine, publisher, leases)
    sweeper = Sweeper(settings, engine, publisher)

    def run(task: Any, uid: object) -> str:
        if not isinstance(uid, str) or len(uid) > 40:
            log.warning("malformed job message dropped", payload=repr(uid)[:100])
            return "malformed"
        return runner.run(uid, tracing.from_task(task.request))

    def webhook(uid: object) -> str:
        if not isinstance(uid, str) or len(uid) > 40:
            return "malformed"
        return webhooks.deliver(engine, settings, publisher, uid, job_document)

    # Late acknowledgement: a message is acknowledged only once its job is settled (the
    # result written, or re-queued), and rejected back to the queue if the worker dies.
    options = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True}
    celery.task(name=RUN_TASK, bind=True, **options)(run)
    celery.task(name=WEBHOOK_TASK, **options)(webhook)
    return celery, runner, sweeper, leases


Installer = Callable[[Any, Settings, Engine], threading.Thread]
"""Registers another task set on the worker's Celery app (the same queue) and returns its
(unstarted) background thread: ``ember.batch.shards.install``."""


def run_worker(
    settings: Settings,
    concurrency: int | None = None,
    parent_pid: int | None = None,
    task_sets: Sequence[Installer] = (),
) -> None:
    """Run a worker in this process until it is stopped (SIGTERM/SIGINT: warm shutdown).
    ``parent_pid``: stop (warm) as soon as that process is no longer this one's parent, so
    a worker that ``ember up`` started never outlives it. ``task_sets``: what else the
    worker serves besides jobs; the caller (``ember worker``) passes the batch shards',
    so jobs never import batch."""
    stop_with_parent(parent_pid)
    traced = tracing.setup(settings, "ember-worker")  # EMBER_OTEL_ENDPOINT
    celery, runner, sweeper, leases = build(settings)
    alive = threading.Event()
    threading.Thread(target=_keep_alive, args=(alive,), name="ember-alive", daemon=True).start()
    for install in task_sets:  # batch shards: the same queue
        install(celery, settings, runner.engine).start()
    name = f"ember@{worker_id()}"
    bind_process(worker=name)
    leases.start()
    sweeper.start()
    _freeze_when_ready()
    # A shard's calls to the model wait for the GIL behind the next shard being parsed:
    # at Python's 5 ms switch interval a call waited longer than the forward pass it
    # fed, and the model's queue ran dry (its busy share 0.93-0.94 -> 0.95-0.96 at 1 ms).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    log.info(
        "job worker starting",
        queue=QUEUE,
        concurrency=concurrency or settings.jobs_worker_concurrency,
        broker=celery.conf.broker_url.split("@")[-1],
    )
    try:
        celery.worker_main(
            [
                "worker",
                "--pool=threads",
                f"--concurrency={concurrency or settings.jobs_worker_concurrency}",
                f"--loglevel={settings.log_level}",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-n",
                name,
                "-Q",
                QUEUE,
            ]
        )
    finally:
        alive.set()
        alive_file().unlink(missing_ok=True)
        sweeper.stop.set()
        leases.stop.set()
        runner.close()
        if traced:
            tracing.shutdown()  # what is still batched is sent


ALIVE_EVERY_S = 10.0
"""How often a running worker touches its liveness file."""


def alive_file(pid: int | None = None) -> Path:
    """The file a running worker touches every ``ALIVE_EVERY_S`` and ``ember worker
    --ping`` reads (in the temp directory: one per user and worker process, so a worker
    that stops never removes another's)."""
    return Path(tempfile.gettempdir()) / f"ember-worker-{os.getuid()}-{pid or os.getpid()}.alive"


def _keep_alive(stop: threading.Event) -> None:
    path = alive_file()
    while not stop.is_set():
        path.touch()
        stop.wait(ALIVE_EVERY_S)


def worker_alive(max_age_s: float = 6 * ALIVE_EVERY_S) -> bool:
    """Whether a worker of this host touched its liveness file within ``max_age_s``: the
    worker pod's liveness probe (``ember worker --ping``; Celery's remote control, and so
    its broadcast ping, is off)."""
    now = time.time()
    for path in alive_file().parent.glob(f"ember-worker-{os.getuid()}-*.alive"):
        try:
            if now - path.stat().st_mtime <= max_age_s:
                return True
        except FileNotFoundError:
            continue
    return False


def _freeze_when_ready() -> Callable[..., None]:
    """Once Celery has booted, move every object the worker made so far (its imports:
    Celery, SQLAlchemy, pyarrow, boto3's service models) out of the collector's way
    (``gc.freeze``). A full collection scanned them all: ~100k objects, 240 ms with the
    GIL held, which stopped every shard's calls (the model idle) once a batch run.
    Returns the signal's receiver."""
    from celery.signals import worker_ready

    def freeze(**_: Any) -> None:
        gc.collect()
        gc.freeze()

    worker_ready.connect(freeze, weak=False)
    return freeze


# --- `ember up`: one supervised worker ------------------------------------------------


def mint_worker_key(engine: Engine) -> str:
    """A fresh worker key for ``ember up``'s worker (the data plane, for any tenant;
    nothing on the control plane); earlier ones are revoked."""
    from ember.registry.db import session_scope
    from ember.registry.tables import ApiKey, KeyScope
    from ember.registry.tenants import DEFAULT_TENANT, create_key, get_tenant

    with session_scope(engine) as session:
        for old in session.exec(
            select(ApiKey).where(ApiKey.name == UP_WORKER_KEY, col(ApiKey.revoked_at).is_(None))
        ):
            old.revoked_at = datetime.now(UTC)
            session.add(old)
        _, key = create_key(
            session, get_tenant(session, DEFAULT_TENANT), UP_WORKER_KEY, KeyScope.worker
        )
    return key


def revoke_worker_keys(engine: Engine) -> None:
    from ember.registry.tables import ApiKey

    with Session(engine) as session:
        for row in session.exec(
            select(ApiKey).where(ApiKey.name == UP_WORKER_KEY, col(ApiKey.revoked_at).is_(None))
        ):
            row.revoked_at = datetime.now(UTC)
            session.add(row)
        session.commit()


def supervise(settings: Settings, engine: Engine, redis_url: str) -> Supervisor:
    """``ember up``'s worker: minted key, the API's URL, the local Redis."""
    env = dict(os.environ)
    if settings.jobs_api_key is None:
        env["EMBER_JOBS_API_KEY"] = mint_worker_key(engine)
    env["EMBER_JOBS_API_URL"] = api_url(settings)
    env["EMBER_REDIS_URL"] = redis_url
    supervisor = Supervisor(env)
    supervisor.start()
    return supervisor
