"""What the command modules share: the consoles, settings, errors, the API client, output.

Kept light: ``ember --help`` imports every command module (to read their help; see
``ember.cli``), so a module here imports at its top only typer, rich's console and
``ember.errors``; anything heavier (the registry, SQLAlchemy, the autoscaler, torch, boto3,
even httpx and the settings) is imported inside the command that uses it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from ember.errors import EmberError

if TYPE_CHECKING:
    from ember.client import EmberClient
    from ember.config import Settings

out = Console()
err = Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def group(help: str) -> typer.Typer:
    """A command group (``ember models``, ``ember jobs``, ...): what a module registers."""
    return typer.Typer(help=help, no_args_is_help=True, rich_markup_mode="markdown")


def commands() -> typer.Typer:
    """A module's top-level commands (``ember up``, ``ember worker``, ...), merged into
    ``ember`` itself."""
    return typer.Typer(rich_markup_mode="markdown")


def load_settings() -> Settings:
    """Settings for a command that acts locally; also routes its logs to stderr."""
    from ember.config import get_settings
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
    """The API client (``EMBER_URL``, ``EMBER_API_KEY``)."""
    if "httpx" not in sys.modules:
        # httpx's own command line (``httpx._main``, imported by ``import httpx`` when
        # click and rich are installed) brings click, rich.progress and pygments: ~0.1 s
        # of a client command's start. Marking it absent makes httpx take its documented
        # fallback (an ``httpx.main`` that says the CLI extra is missing); nothing in
        # Ember runs httpx's CLI.
        sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
    from ember.client import EmberClient

    return EmberClient.from_env()


def emit(data: Any, columns: list[str] | None = None, as_json: bool = False) -> None:
    """Print a result: a table for lists (when columns are given), JSON otherwise."""
    if as_json or columns is None or not isinstance(data, list):
        out.print_json(json.dumps(data, default=str))
        return
    from rich.table import Table

    table = Table(*columns)
    for row in data:
        table.add_row(*(_cell(row.get(c)) for c in columns))
    out.print(table)


def _cell(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value)
    return "" if value is None else str(value)
