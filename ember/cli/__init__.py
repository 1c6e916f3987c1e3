"""The ``ember`` command.

Server side: ``ember up`` (everything on one machine), ``ember serve`` (the API only),
``ember worker``, ``ember beat``, ``ember engine``. Client side (talks to the API at
``EMBER_URL`` with ``EMBER_API_KEY``): ``ember models``, ``ember deployments``, ``ember
keys``, ``ember tenants``, ``ember jobs``, ``ember batch``, ``ember cache``.

One way to add a command: a module of this package defines ``app`` — ``group(help)``
for a command group, ``commands()`` for top-level commands — and is named in
``COMMANDS`` below. Its top imports stay light (``ember.cli.common`` says which): typer
imports every module to print ``ember --help``, and a heavy import there is paid by
every command.
"""

from __future__ import annotations

from importlib import import_module

import typer

COMMANDS: tuple[tuple[str, str | None], ...] = (
    ("server", None),  # serve, up
    ("beat", None),
    ("engine", None),  # engine, calibrate
    ("worker", None),
    ("simulate", None),
    ("tenants", "tenants"),
    ("keys", "keys"),
    ("models", "models"),
    ("deployments", "deployments"),
    ("batch", "batch"),
    ("jobs", "jobs"),
    ("cache", "cache"),
)
"""``(module, group name)``, in the order ``ember --help`` lists them; a name of ``None``
merges the module's commands into ``ember`` itself."""

app = typer.Typer(
    help="Ember: register, deploy and call model versions — warm pools, fast cold starts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
for _module, _name in COMMANDS:
    app.add_typer(import_module(f"ember.cli.{_module}").app, name=_name)
