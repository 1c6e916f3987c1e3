"""The ``ember`` command.

Server side: ``ember up`` (everything on one machine), ``ember serve`` (the API only).
Client side (talks to the API at ``EMBER_URL`` with ``EMBER_API_KEY``): ``ember models``,
``ember deployments``, ``ember keys``, ``ember tenants``.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy import Engine

from ember.client import EmberClient
from ember.config import Settings, get_settings
from ember.errors import Conflict, EmberError

app = typer.Typer(
    help="Ember: register, deploy and call model versions — warm pools, fast cold starts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
out = Console()
err = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


def load_settings() -> Settings:
    """Settings for a command that acts locally; also routes its logs to stderr."""
    from ember.logs import configure_logging

    try:
        settings = get_settings()
    except ValueError as exc:  # pydantic ValidationError: say which setting and why
        err.print(f"[red]invalid configuration:[/red]\n{exc}")
        raise typer.Exit(2) from exc
    configure_logging(settings.log_level, settings.log_format)
    return settings


@contextmanager
def friendly_errors() -> Iterator[None]:
    try:
        yield
    except EmberError as exc:
        err.print(f"[red]error:[/red] {exc.title}: {exc.detail}")
        raise typer.Exit(1) from exc


def client() -> EmberClient:
    return EmberClient.from_env()


def emit(data: Any, columns: list[str] | None = None, as_json: bool = False) -> None:
    """Print a result: a table for lists (when columns are given), JSON otherwise."""
    if as_json or columns is None or not isinstance(data, list):
        out.print_json(json.dumps(data, default=str))
        return
    table = Table(*columns)
    for row in data:
        table.add_row(*(_cell(row.get(c)) for c in columns))
    out.print(table)


def _cell(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value)
    return "" if value is None else str(value)


JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


# --- server -----------------------------------------------------------------------------


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

    engine, generated = prepared or prepare(settings)
    url = f"http://{settings.host}:{settings.port}"
    # Plain print: these lines are meant to be copied, so no wrapping or markup.
    print(f"Ember {url}  (data: {settings.data_dir})")
    if generated:
        print(f"admin API key (shown once, store it now): {generated}")
        print(f"  export EMBER_API_KEY={generated}")
    elif settings.admin_key is None:
        print("admin API key: the one printed on first start (or `ember keys create --local`)")
    sys.stdout.flush()
    api = create_app(settings, engine, freeze_gc=True)
    uvicorn.run(api, host=settings.host, port=settings.port, log_config=None, access_log=False,
                reload=reload)  # fmt: skip


# --- tenants and keys -------------------------------------------------------------------

tenants_app = typer.Typer(help="Tenants (admin).", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
app.add_typer(tenants_app, name="tenants")
app.add_typer(keys_app, name="keys")


@tenants_app.command("create")
def tenants_create(name: str, as_json: JsonOpt = False) -> None:
    """Create a tenant."""
    with friendly_errors():
        emit(client().post("/v1/tenants", {"name": name}), as_json=as_json)


@tenants_app.command("ls")
def tenants_ls(as_json: JsonOpt = False) -> None:
    """List tenants."""
    with friendly_errors():
        emit(client().paginate("/v1/tenants"), ["name", "created_at"], as_json)


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Option(help="A label for the key.")] = "default",
    tenant: Annotated[str | None, typer.Option(help="Tenant (default: yours).")] = None,
    admin: Annotated[bool, typer.Option(help="Create an admin key.")] = False,
    worker: Annotated[
        bool, typer.Option(help="Create a worker key (job and batch workers on other hosts).")
    ] = False,
    local: Annotated[
        bool, typer.Option(help="Write to the local registry directly (no API, no key needed).")
    ] = False,
) -> None:
    """Create an API key; its secret is printed once. Admin and worker keys need an admin
    key (or --local)."""
    if admin and worker:
        raise typer.BadParameter("give --admin or --worker, not both")
    scope = "admin" if admin else "worker" if worker else "tenant"
    if local:
        out.print(_local_key(name, tenant, scope))
        return
    with friendly_errors():
        body = {"name": name, "tenant": tenant, "scope": scope}
        emit(client().post("/v1/keys", body))


def _local_key(name: str, tenant: str | None, scope: str) -> str:
    from ember.api.app import prepare
    from ember.registry.db import session_scope
    from ember.registry.tables import KeyScope
    from ember.registry.tenants import DEFAULT_TENANT, create_key, get_tenant

    engine, _ = prepare(load_settings())
    with friendly_errors(), session_scope(engine) as session:
        row = get_tenant(session, tenant or DEFAULT_TENANT)
        _, key = create_key(session, row, name, KeyScope(scope))
    return key


@keys_app.command("ls")
def keys_ls(as_json: JsonOpt = False) -> None:
    """List your tenant's keys (never their secrets)."""
    with friendly_errors():
        cols = ["id", "name", "scope", "prefix", "created_at", "revoked_at"]
        emit(client().paginate("/v1/keys"), cols, as_json)


@keys_app.command("revoke")
def keys_revoke(key_id: int) -> None:
    """Revoke a key by id."""
    with friendly_errors():
        emit(client().delete(f"/v1/keys/{key_id}"))


from ember.cli_models import deployments_app, models_app  # noqa: E402

app.add_typer(models_app, name="models")
app.add_typer(deployments_app, name="deployments")
import ember.cli_batch  # noqa: E402 - registers `ember batch`, `ember beat`
import ember.cli_engine  # noqa: E402,F401 - registers `ember engine`, `ember calibrate`
from ember import cli_jobs  # noqa: E402,F401 - registers `ember jobs`, `ember worker`


def _resolve_version(
    settings: Settings, model: str, version: str
) -> tuple[str, str, list[dict[str, Any]] | None]:
    """``ember cache warm``: a version's artifact, digest and manifest, from the registry
    API (so a key sees only its own tenant's models)."""
    row = client().get(f"/v1/models/{model}/versions/{version}")
    if row["status"] != "ready" or not row["sha256"]:
        raise Conflict(f"{model}:{version} is {row['status']}, not ready to cache")
    return str(row["artifact_uri"]), str(row["sha256"]), row.get("files")


from ember.loader.cli import make_cache_app  # noqa: E402
from ember.pools.cli import simulate_command  # noqa: E402

app.add_typer(make_cache_app(_resolve_version), name="cache")
app.command("simulate")(simulate_command)
