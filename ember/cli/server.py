"""``ember up`` (everything on one machine) and ``ember serve`` (the API only)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

from ember.cli.common import commands, friendly_errors, load_settings

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from ember.config import Settings

app = commands()


@app.command()
def serve(
    reload: Annotated[bool, typer.Option(help="Reload on code changes (development).")] = False,
) -> None:
    """Run the API server on EMBER_HOST:EMBER_PORT (no local Redis)."""
    _run_api(load_settings(), reload)


@app.command()
def up() -> None:
    """Run Ember on one machine with embedded defaults: SQLite registry, file:// object
    store and weight cache under EMBER_DATA_DIR, a local Redis unless EMBER_REDIS_URL is
    set, and the API on EMBER_HOST:EMBER_PORT."""
    from ember.api.app import prepare
    from ember.local import ensure_redis, seed_examples

    settings = load_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    # A SIGTERM stops `ember up` as a Ctrl-C does, through the `finally` below (uvicorn
    # hands the signal back to this handler once the API has shut down).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with friendly_errors():
        redis = ensure_redis(settings)  # this data directory's own, stopped on the way out
    stops: list[Callable[[], None]] = [redis.stop]
    try:
        with friendly_errors():
            prepared = prepare(settings)
            seeded = seed_examples(settings, prepared[0])
        redis_url = redis.url  # carries the password: printed without it
        print(f"redis:    {redis.shown}")
        if seeded:
            print(f"example:  minilm:1 pushed to {seeded} and deployed as `minilm`")
        from ember.jobs.worker import supervise

        worker = supervise(settings, prepared[0], redis_url)  # restarted whenever it dies
        stops.insert(0, worker.stop)
        pid = worker.proc.pid if worker.proc else "?"
        print(f"worker:   pid {pid} (`ember worker`, supervised)")
        from ember.batch.beat import supervise as supervise_beat

        beat = supervise_beat(settings, redis_url)  # fires batch schedules
        stops.insert(0, beat.stop)
        print(f"beat:     pid {beat.proc.pid if beat.proc else '?'} (`ember beat`, supervised)")
        _run_api(settings, reload=False, prepared=prepared)
    finally:  # beat, worker, then Redis (the worker's warm shutdown still needs it)
        for stop in stops:
            stop()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _run_api(
    settings: Settings, reload: bool, prepared: tuple[Engine, str | None] | None = None
) -> None:
    import uvicorn

    from ember.api.app import create_app, prepare
    from ember.config import SWITCH_INTERVAL_S
    from ember.web.http import SERVER_OPTIONS

    engine, generated = prepared or prepare(settings)
    url = f"http://{settings.host}:{settings.port}"
    # Plain print: these lines are meant to be copied, so no wrapping or markup.
    print(f"Ember {url}  (data: {settings.data_dir})")
    print(f"dashboard {url}/ui  (sign in with an API key)")
    if generated:
        print(f"admin API key (shown once, store it now): {generated}")
        print(f"  export EMBER_API_KEY={generated}")
    elif settings.admin_key is None:
        print("admin API key: the one printed on first start (or `ember keys create --local`)")
    sys.stdout.flush()
    api = create_app(settings, engine, freeze_gc=True)
    # The event loop must not wait 5 ms for the GIL behind a thread's pure Python
    # (the prediction log's digests, the controller's registry reads): SWITCH_INTERVAL_S.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.run(api, host=settings.host, port=settings.port, reload=reload, **SERVER_OPTIONS)
