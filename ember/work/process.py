"""The plumbing of Ember's worker processes (``ember worker``, ``ember beat``): wait for the
registry's schema, stop when the parent is gone (replicas started by the API's pools too:
imported there, so nothing heavy at import time), and a supervisor that restarts a child.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

from ember.errors import CapacityError
from ember.logs import get_logger

if TYPE_CHECKING:
    from sqlalchemy import Engine

log = get_logger(__name__)


def wait_for_schema(engine: Engine, timeout_s: float = 60.0) -> None:
    """The API migrates the registry; a worker started beside it waits for the jobs table."""
    from sqlalchemy import inspect

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if inspect(engine).has_table("jobs"):
                return
        except Exception as exc:
            if time.monotonic() > deadline:
                raise CapacityError(f"the registry is unreachable: {exc}") from exc
        if time.monotonic() > deadline:
            raise CapacityError("the registry has no jobs table: start the API first (it migrates)")
        time.sleep(0.5)


def stop_with_parent(parent: int | None) -> None:
    """With a ``parent`` pid: SIGTERM this process once that one is no longer its parent
    (``ember up`` or the API killed outright ran no shutdown), watched from a daemon
    thread. None: nothing to watch."""
    if parent is not None:
        watch = threading.Thread(target=_watch_parent, args=(parent,), name="ember-parent")
        watch.daemon = True
        watch.start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    log.warning("the parent process is gone; stopping", parent=parent)
    os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """Runs ``ember worker`` as a child process and starts it again when it dies (with a
    backoff that resets once a worker has lived a minute)."""

    def __init__(self, env: dict[str, str], stop_timeout_s: float = 20.0) -> None:
        self.env = env
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(
            target=self._loop, name="ember-worker-supervisor", daemon=True
        )

    def start(self) -> None:
        self._spawn()
        self.thread.start()

    def _spawn(self) -> None:
        # Its own session: a Ctrl-C in the terminal reaches `ember up`, which stops the
        # worker itself; --parent-pid covers `ember up` being killed outright.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ember", "worker", "--parent-pid", str(os.getpid())],
            env=self.env,
            start_new_session=True,
        )
        self.started = time.monotonic()
        log.info("job worker started", pid=self.proc.pid, restarts=self.restarts)

    def _loop(self) -> None:
        delay = 1.0
        while not self.stopping.wait(0.5):
            proc = self.proc
            if proc is None or proc.poll() is None:
                continue
            if time.monotonic() - self.started > 60:
                delay = 1.0
            log.warning(
                "job worker exited; starting another",
                pid=proc.pid,
                status=proc.returncode,
                in_s=delay,
            )
            if self.stopping.wait(delay):
                return
            self.restarts += 1
            self._spawn()
            delay = min(30.0, delay * 2)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)  # warm shutdown: running jobs finish or are restored
        try:
            proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
