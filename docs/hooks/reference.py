"""mkdocs hook: the reference pages' generated parts, written from the code at build time.

A page holds a marker where a generated part goes: ``<!-- generated: settings -->`` (the
settings table, from ``ember.config.Settings``), ``<!-- generated: cli -->`` (every
command, from the typer app) or ``<!-- generated: openapi -->`` (every operation and
schema, from the API's OpenAPI document). Nothing generated is kept in the repository, so
the pages cannot fall out of step with the code.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER = re.compile(r"<!-- generated: (\w+) -->")


def settings_markdown() -> str:
    from ember.config import settings_table

    return settings_table()


def cli_markdown() -> str:
    import typer
    import typer.main
    from typer.cli import get_docs_for_click

    from ember.cli import app

    command = typer.main.get_command(app)
    text = get_docs_for_click(obj=command, ctx=typer.Context(command), name="ember", indent=1)
    return text.strip() + "\n"


def _cell(text: Any) -> str:
    return " ".join(str(text or "").split()).replace("|", "\\|")


def _schema_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#{_anchor(name)})"
    if "anyOf" in schema:
        return " or ".join(_schema_name(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"array of {_schema_name(schema.get('items', {}))}"
    return f"`{schema.get('type', 'any')}`"


def _anchor(name: str) -> str:
    return "schema-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def openapi_document() -> dict[str, Any]:
    """The API's document as the code builds it with the default settings (the app is never
    started: no I/O, no database)."""
    from ember.api.app import create_app
    from ember.config import Settings

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("EMBER_")}
    try:
        data_dir = Path(tempfile.gettempdir()) / "ember-docs-openapi"
        document: dict[str, Any] = create_app(Settings(data_dir=data_dir)).openapi()
    finally:
        os.environ.update(saved)
    return document


def openapi_markdown() -> str:
    doc = openapi_document()
    out: list[str] = []
    methods = ("get", "put", "post", "patch", "delete")
    out.append("| operation | what |\n|---|---|")
    for path, item in doc["paths"].items():
        for method in methods:
            if method in item:
                op = item[method]
                out.append(f"| `{method.upper()} {path}` | {_cell(op.get('summary'))} |")
    out.append("")
    for path, item in doc["paths"].items():
        for method in methods:
            if method not in item:
                continue
            op = item[method]
            out.append(f"### `{method.upper()} {path}`\n")
            if op.get("description"):
                out.append(op["description"].strip() + "\n")
            params = op.get("parameters") or []
            if params:
                out.append("| parameter | in | required | type | description |")
                out.append("|---|---|---|---|---|")
                for p in params:
                    out.append(
                        f"| `{p['name']}` | {p['in']} | {'yes' if p.get('required') else 'no'} "
                        f"| {_schema_name(p.get('schema', {}))} | {_cell(p.get('description'))} |"
                    )
                out.append("")
            body = op.get("requestBody")
            if body:
                kinds = ", ".join(
                    f"`{ctype}` {_schema_name(c.get('schema', {}))}"
                    for ctype, c in body.get("content", {}).items()
                )
                out.append(f"Body{' (required)' if body.get('required') else ''}: {kinds}\n")
            responses = op.get("responses") or {}
            if responses:
                out.append("| status | answer |\n|---|---|")
                for status, r in responses.items():
                    shapes = ", ".join(
                        _schema_name(c["schema"])
                        for c in r.get("content", {}).values()
                        if c.get("schema")  # an empty schema says nothing
                    )
                    out.append(f"| {status} | {_cell(r.get('description'))} {shapes} |")
                out.append("")
    schemas = doc.get("components", {}).get("schemas", {})
    if schemas:
        out.append("## Schemas\n")
    for name, schema in schemas.items():
        out.append(f"### {name} {{ #{_anchor(name)} }}\n")
        if schema.get("description"):
            out.append(_cell(schema["description"]) + "\n")
        props = schema.get("properties") or {}
        if props:
            required = set(schema.get("required") or ())
            out.append("| field | type | required | description |\n|---|---|---|---|")
            for field, spec in props.items():
                out.append(
                    f"| `{field}` | {_schema_name(spec)} | {'yes' if field in required else 'no'} "
                    f"| {_cell(spec.get('description') or spec.get('title'))} |"
                )
            out.append("")
        elif schema.get("enum"):
            out.append("One of " + ", ".join(f"`{v}`" for v in schema["enum"]) + ".\n")
    return "\n".join(out) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "settings": settings_markdown,
    "cli": cli_markdown,
    "openapi": openapi_markdown,
}
_cache: dict[str, str] = {}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def expand(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_uri}: no generator named {name!r}")
        if name not in _cache:
            _cache[name] = GENERATORS[name]()
        return _cache[name]

    return MARKER.sub(expand, markdown)
