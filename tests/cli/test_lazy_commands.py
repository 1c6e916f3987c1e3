"""``ember`` builds its commands on demand (``ember.cli.LazyCommands``): the tree it
builds is typer's own, a command imports only its module, and ``COMMANDS`` names what
each module defines. typer's pydantic coercion is built for a value to coerce only
(``ember.cli.ValueFirst``)."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from importlib import import_module
from typing import Any

import pytest
import typer
import typer.core
import typer.main
import typer.models
from typer.cli import get_docs_for_click
from typer.testing import CliRunner

import ember.cli
from ember.client import tls_context


def eager_app() -> typer.Typer:
    """``ember`` as typer would build it whole: every module added with ``add_typer``."""
    app = typer.Typer(
        help=ember.cli.app.info.help,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        rich_markup_mode="markdown",
    )
    for module, names in ember.cli.COMMANDS:
        app.add_typer(
            import_module(f"ember.cli.{module}").app,
            name=names if isinstance(names, str) else None,
        )
    return app


def walk(command: Any, path: list[str]) -> Iterator[list[str]]:
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from walk(sub, [*path, name])


def test_commands_names_what_each_module_defines() -> None:
    for module, names in ember.cli.COMMANDS:
        group = typer.main.get_group(import_module(f"ember.cli.{module}").app)
        if isinstance(names, str):
            assert group.commands, module  # a group module defines a group's commands
        else:
            assert tuple(group.commands) == names, module


def test_the_tree_is_typers_own() -> None:
    """Every command's help, options and arguments are those of the eagerly built tree,
    and so is the reference the docs are generated from."""
    eager = eager_app()
    trees = typer.main.get_command(ember.cli.app), typer.main.get_command(eager)
    docs = [
        get_docs_for_click(obj=command, ctx=typer.Context(command), name="ember", indent=1)
        for command in trees
    ]
    assert docs[0] == docs[1]
    paths = list(walk(trees[1], []))
    assert list(walk(trees[0], [])) == paths and len(paths) > 50
    runner = CliRunner()
    errors = [[], ["models"], ["modls"], ["models", "lss"], ["models", "ls", "-x"]]
    for args in [*([*path, "--help"] for path in paths), *errors]:
        got, want = (
            runner.invoke(app, args, env={"COLUMNS": "120"}) for app in (ember.cli.app, eager)
        )
        assert (got.exit_code, got.output) == (want.exit_code, want.output), args


PROBE = """
import json, sys
from ember.cli import app
try:
    app(sys.argv[1:], prog_name="ember")
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


def run(*args: str) -> tuple[set[str], str]:
    """``ember ARGS`` in a fresh interpreter (the API's address a closed port): the
    modules it imported, and what it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env |= {"EMBER_URL": "http://127.0.0.1:9", "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-c", PROBE, *args], env=env,
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    *printed, modules = done.stdout.splitlines()
    return set(json.loads(modules)), "\n".join(printed) + done.stderr


def commands_loaded(*args: str) -> set[str]:
    return {m for m in run(*args)[0] if m.startswith("ember.cli.")}


def test_a_command_imports_only_its_module() -> None:
    every = {f"ember.cli.{module}" for module, _ in ember.cli.COMMANDS} | {"ember.cli.common"}
    assert commands_loaded("models", "ls", "--help") == {"ember.cli.common", "ember.cli.models"}
    assert commands_loaded("serve", "--help") == {"ember.cli.common", "ember.cli.server"}
    assert commands_loaded("--help") == every


def test_pydantic_only_for_a_value_to_coerce() -> None:
    modules, printed = run("models", "ls")
    assert "cannot reach Ember" in printed
    assert "pydantic" not in modules
    modules, printed = run("deployments", "canary", "m", "v", "--weight", "ten")
    assert "Invalid value for '--weight'" in printed and "valid integer" in printed
    assert "pydantic" in modules


def test_root_help_builds_the_groups_not_their_commands(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = typer.main.get_command(ember.cli.app)
    assert isinstance(root, typer.core.TyperGroup)
    root.get_help(typer.Context(root, info_name="ember"))
    assert "Models and versions." in capsys.readouterr().out
    models = root.commands["models"]
    assert isinstance(models, typer.core.TyperGroup)
    assert isinstance(models.commands, ember.cli.LazyCommands)
    assert all(
        isinstance(slot, typer.models.CommandInfo) for slot in models.commands.slots.values()
    )
    assert models.commands["ls"].name == "ls"  # built when read
    assert not isinstance(models.commands.slots["ls"], typer.models.CommandInfo)


def test_tls_is_verified_wherever_it_can_happen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client loads the CA bundle only where TLS can happen; elsewhere its context
    still requires a certificate and checks the host name (it trusts no CA)."""
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    assert tls_context("https://ember.example") is True
    assert tls_context("HTTPS://ember.example") is True
    bare = tls_context("http://127.0.0.1:8000")
    assert isinstance(bare, ssl.SSLContext)
    assert bare.verify_mode == ssl.CERT_REQUIRED and bare.check_hostname
    assert bare.get_ca_certs() == []
    monkeypatch.setenv("HTTPS_PROXY", "https://proxy.example:3128")
    assert tls_context("http://127.0.0.1:8000") is True
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert isinstance(tls_context("http://127.0.0.1:8000"), ssl.SSLContext)
