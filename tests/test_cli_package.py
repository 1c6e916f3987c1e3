"""The ``ember`` command as a package: one way to register a command, and commands that
import only what they use (printing help or listing models loads no registry, no
SQLAlchemy, no autoscaler, no torch, no boto3)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main

import ember.cli
from ember.api.app import create_app
from ember.config import Settings
from tests import services
from tests.api.conftest import ADMIN_KEY

PACKAGE = Path(ember.cli.__file__).parent
HEAVY = ("sqlalchemy", "sqlmodel", "alembic", "ember.registry", "ember.pools.autoscaler",
         "ember.api", "torch", "boto3", "botocore", "numpy", "celery", "fastapi", "uvicorn",
         "ember.config", "pydantic_settings")  # fmt: skip
"""Modules ``ember --help`` and a client command must not import."""

PROBE = """
import json, sys
from ember.cli import app
try:
    app(sys.argv[2:], prog_name="ember")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def probe(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[int, set[str], str]:
    """Run ``ember ARGS`` in a fresh interpreter: its exit code, the modules it imported,
    and what it printed."""
    report = tmp_path / "modules.json"
    full = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | env
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(report), *args],
        env=full | {"COLUMNS": "200"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    data = json.loads(report.read_text())
    return int(data["code"] or 0), set(data["modules"]), done.stdout + done.stderr


def heavy_in(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


def test_help_imports_no_heavy_module(tmp_path: Path) -> None:
    code, modules, text = probe(tmp_path, {}, "--help")
    assert code == 0, text
    assert "models" in text and "deployments" in text and "simulate" in text
    assert heavy_in(modules) == []
    assert "httpx" not in modules  # only a command that calls the API imports the client


@pytest.fixture
def api(data_dir: Path) -> Iterator[dict[str, str]]:
    settings = Settings(data_dir=data_dir, admin_key=ADMIN_KEY, pools_enabled=False)  # type: ignore[arg-type]
    with services.serve_app(create_app(settings)) as url:
        yield {"EMBER_URL": url, "EMBER_API_KEY": ADMIN_KEY}


def test_a_client_command_talks_to_the_api_with_light_imports(
    api: dict[str, str], tmp_path: Path
) -> None:
    code, modules, text = probe(tmp_path, api, "models", "create", "light")
    assert code == 0, text
    code, modules, text = probe(tmp_path, api, "models", "ls", "--json")
    assert code == 0, text
    assert [m["name"] for m in json.loads(text)] == ["light"]
    assert heavy_in(modules) == []
    # a bad key still ends as the API's problem, printed, not a traceback
    code, _, text = probe(tmp_path, api | {"EMBER_API_KEY": "ek_wrong"}, "models", "ls")
    assert code == 1 and "error:" in text and "Traceback" not in text


def test_a_bad_port_is_named_not_a_traceback(tmp_path: Path) -> None:
    code, _, text = probe(tmp_path, {"EMBER_PORT": "http"}, "models", "ls")
    assert code == 1 and "EMBER_PORT" in text and "Traceback" not in text


def test_every_command_module_is_registered_one_way() -> None:
    """Each module of the package (but ``common``) defines ``app`` and is named in
    ``COMMANDS``; nothing else adds commands to ``ember``."""
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "common"}
    assert modules == {m for m, _ in ember.cli.COMMANDS}
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                assert not (node.func.attr == "add_typer" and path.stem != "__init__"), path
    group = typer.main.get_command(ember.cli.app)
    assert isinstance(group, typer.core.TyperGroup)
    names = list(group.commands)
    assert names == [
        "serve", "up", "beat", "engine", "calibrate", "worker", "simulate",
        "tenants", "keys", "models", "deployments", "batch", "jobs", "cache",
    ]  # fmt: skip


def test_simulate_defaults_are_the_autoscalers() -> None:
    from ember.cli import simulate
    from ember.pools.autoscaler import PromotionTimes

    times = PromotionTimes()
    assert (
        times.warm_s,
        times.standby_s,
        times.cold_s,
    ) == (simulate.WARM_S, simulate.STANDBY_S, simulate.COLD_S)
