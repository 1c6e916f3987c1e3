"""The manual (mkdocs.yml, docs/): it builds with --strict, its generated reference pages
say what the code does, and every shell and Python example in it is either run here
against a live platform or excluded with its reason.

An example is a fenced ``sh``, ``bash`` or ``python`` block. The line before it (blank
lines aside) says what the test does with it: ``<!-- docs-test: run -->`` runs it, in the
order of the site's navigation, against one live API with the pools controller and real
``ember engine`` replicas; ``<!-- docs-test: skip: REASON -->`` leaves it out, saying why
(it needs AWS, a Kubernetes cluster, a GPU, the ``minilm`` example ``ember up`` seeds,
...). The examples address the API as ``localhost:8000``, as on a machine that ran ``make
up``; the test points them at its own API's port.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from ember.config import Settings
from tests.api.conftest import ADMIN_KEY
from tests.gateway.conftest import Live, live_api

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!-- docs-test: (run|skip: (.+)) -->$")
LANGUAGES = ("sh", "bash", "python")


@dataclass
class Example:
    page: str
    line: int
    language: str
    code: str
    run: bool
    reason: str | None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def examples(page: Path) -> list[Example]:
    found: list[Example] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if fence.group(1) in LANGUAGES:
            before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            marker = MARKER.match(before)
            found.append(Example(
                str(page.relative_to(DOCS)), i + 1, fence.group(1), "\n".join(lines[i + 1:end]),
                run=bool(marker and marker.group(1) == "run"),
                reason=marker.group(2) if marker and marker.group(2) else None,
            ))  # fmt: skip
            if marker is None:
                found[-1].reason = ""  # unmarked: the test below names it
        i = end + 1
    return found


def nav_pages() -> list[str]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def walk(items: list[Any]) -> Iterator[str]:
        for item in items:
            value = item if isinstance(item, str) else next(iter(item.values()))
            if isinstance(value, list):
                yield from walk(value)
            else:
                yield value

    return list(walk(config["nav"]))


def all_examples() -> list[Example]:
    return [e for page in sorted(DOCS.rglob("*.md")) for e in examples(page)]


def test_every_page_is_in_the_navigation() -> None:
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == set(nav_pages())


def test_every_example_is_run_or_excluded_with_its_reason() -> None:
    found = all_examples()
    unmarked = [str(e) for e in found if not e.run and not e.reason]
    assert not unmarked, f"mark these examples run or skip (with a reason): {unmarked}"
    assert sum(e.run for e in found) >= 4


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(out)],
        cwd=ROOT, env=env | {"NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def page_text(site: Path, page: str) -> str:
    html = (site / page / "index.html").read_text()
    return re.sub(r"<[^>]+>", "", html).replace("&amp;", "&")


def test_the_settings_reference_is_every_setting(site: Path) -> None:
    """Generated from ``Settings`` at build time: every variable, with its description."""
    from ember.config import settings_table

    text = page_text(site, "reference/settings")
    for name, field in Settings.model_fields.items():
        assert f"EMBER_{name.upper()}" in text, name
        assert field.description and field.description.split("`")[0].strip()[:40] in text, name
    assert len(settings_table().splitlines()) - 2 == len(Settings.model_fields)


def test_the_cli_reference_is_every_command(site: Path) -> None:
    import typer.main

    from ember.cli import app

    text = page_text(site, "reference/cli")

    def walk(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*path, name])

    for path, command in walk(typer.main.get_command(app), ["ember"]):
        assert " ".join(path) in text, path
        for param in command.params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("--"):
                    assert opt in text, (path, opt)


def test_the_http_reference_is_every_operation(site: Path) -> None:
    spec = importlib.util.spec_from_file_location("docs_hook", DOCS / "hooks" / "reference.py")
    assert spec and spec.loader
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    text = page_text(site, "reference/http-api")
    for path, item in hook.openapi_document()["paths"].items():
        for method in ("get", "put", "post", "patch", "delete"):
            if method in item:
                assert f"{method.upper()} {path}" in text, (method, path)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Live, Path]]:
    data_dir = tmp_path_factory.mktemp("docs-platform")
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("EMBER_")}
    try:
        with live_api(data_dir, standby_replicas=0) as live:
            yield live, data_dir
    finally:
        os.environ.update(saved)


def run(example: Example, live: Live, data_dir: Path) -> subprocess.CompletedProcess[str]:
    port = live.url.rsplit(":", 1)[1]
    code = example.code.replace("localhost:8000", f"127.0.0.1:{port}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env |= {
        "EMBER_URL": live.url,
        "EMBER_API_KEY": ADMIN_KEY,
        "EMBER_DATA_DIR": str(data_dir),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "COLUMNS": "200",
        "XDG_CACHE_HOME": str(data_dir / "xdg-cache"),
    }
    if example.language == "python":
        cmd = [sys.executable, "-c", code]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_examples_run_against_a_live_platform(platform: tuple[Live, Path]) -> None:
    live, data_dir = platform
    order = {page: i for i, page in enumerate(nav_pages())}
    runnable = sorted((e for e in all_examples() if e.run), key=lambda e: (order[e.page], e.line))
    for example in runnable:
        # as a reader does: the deployments made so far are serving before the next step
        for deployment in live.client.get("/v1/deployments").json()["items"]:
            name = deployment["name"]
            live.wait(lambda name=name: bool(live.ready(name)), f"a ready replica of {name}")
        done = run(example, live, data_dir)
        assert done.returncode == 0, f"{example}:\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, f"{example}:\n{done.stderr}"
    # what the examples said they did is what the platform now holds
    versions = live.client.get("/v1/models/mlp/versions").json()["items"]
    assert sorted(v["version"] for v in versions) == ["1", "2"]
    assert all(v["status"] == "ready" for v in versions)
    mlp = live.client.get("/v1/deployments/mlp").json()
    assert mlp["min_hot"] == 2 and mlp["max_batch_size"] == 64, mlp
    assert mlp["traffic"] == {"1": 100}, mlp  # promoted to 2, then rolled back
    canary = live.client.get("/v1/deployments/mlp-canary").json()
    assert canary["traffic"] == {"1": 100}, canary
    pushed = live.client.get("/v1/models/tiny-llm/versions/2").json()  # a directory, whole
    assert pushed["status"] == "ready" and pushed["engine"] == "vllm", pushed
    assert {f["path"] for f in pushed["files"]} >= {"config.json", "model.safetensors.index.json"}
    dry = live.client.get("/v1/models/tiny-llm/versions/3")  # --dry-run registered nothing
    assert dry.status_code == 404, dry.text
    predicted = live.predict("mlp")
    assert predicted.status_code == 200, predicted.text
