"""``ember worker``: run a job worker (Celery; it scores jobs and batch shards)."""

from __future__ import annotations

from typing import Annotated

import typer

from ember.cli.common import commands, err, friendly_errors, load_settings

app = commands()


@app.command()
def worker(
    concurrency: Annotated[
        int | None, typer.Option(help="Jobs at once (default EMBER_JOBS_WORKER_CONCURRENCY).")
    ] = None,
    parent_pid: Annotated[
        int | None,
        typer.Option(help="Stop once this process is no longer the parent (`ember up`)."),
    ] = None,
    ping: Annotated[
        bool,
        typer.Option(
            "--ping",
            help="Do not run one: exit 0 if a worker of this host showed it was alive in "
            "the last minute, else 1 (a container's liveness probe).",
        ),
    ] = False,
) -> None:
    """Run a job worker (Celery on the Redis at EMBER_REDIS_URL). It calls the gateway at
    EMBER_JOBS_API_URL with the admin key EMBER_JOBS_API_KEY, acting for each job's tenant."""
    if ping:  # no settings, no database, no broker: only the worker's liveness file
        from ember.jobs.worker import worker_alive

        alive = worker_alive()
        err.print("a worker of this host is alive" if alive else "no live worker on this host")
        raise typer.Exit(0 if alive else 1)
    from ember.batch.shards import install as install_batch
    from ember.jobs.worker import run_worker

    settings = load_settings()
    with friendly_errors():
        run_worker(settings, concurrency, parent_pid, task_sets=(install_batch,))
