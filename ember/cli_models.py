"""``ember models`` and ``ember deployments``: thin commands over the HTTP API."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from ember.cli import JsonOpt, client, emit, friendly_errors, load_settings, out
from ember.errors import Conflict, InvalidInput, NotFound

models_app = typer.Typer(
    help="Models and versions.", no_args_is_help=True, rich_markup_mode="markdown"
)
deployments_app = typer.Typer(
    help="Deployments: routing and pool policy.", no_args_is_help=True, rich_markup_mode="markdown"
)
VERSION_COLUMNS = ["version", "engine", "status", "size_bytes", "tensor_count", "sha256"]


def _json_option(value: str | None, what: str) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"{what} is not valid JSON: {exc.msg}") from exc
    if not isinstance(parsed, dict):
        raise typer.BadParameter(f"{what} must be a JSON object")
    return parsed


@models_app.command("create")
def models_create(name: str, description: str = "", as_json: JsonOpt = False) -> None:
    """Create a model."""
    with friendly_errors():
        emit(client().post("/v1/models", {"name": name, "description": description}), as_json=True)


@models_app.command("ls")
def models_ls(as_json: JsonOpt = False) -> None:
    """List models."""
    with friendly_errors():
        cols = ["name", "version_count", "latest_version", "created_at"]
        emit(client().paginate("/v1/models"), cols, as_json)


@models_app.command("get")
def models_get(name: str) -> None:
    """Show a model."""
    with friendly_errors():
        emit(client().get(f"/v1/models/{name}"))


@models_app.command("rm")
def models_rm(name: str) -> None:
    """Delete a model and its versions (refused while a deployment serves it)."""
    with friendly_errors():
        client().delete(f"/v1/models/{name}")
        out.print(f"deleted model {name}")


@models_app.command("versions")
def models_versions(name: str, as_json: JsonOpt = False) -> None:
    """List a model's versions."""
    with friendly_errors():
        emit(client().paginate(f"/v1/models/{name}/versions"), VERSION_COLUMNS, as_json)


@models_app.command("register")
def models_register(
    name: str,
    version: Annotated[str, typer.Option("--version", "-v")],
    artifact_uri: Annotated[str, typer.Option("--uri", help="file:// or s3:// URI.")],
    engine: Annotated[str, typer.Option(help="torch | transformers | vllm")] = "torch",
    engine_config: Annotated[str | None, typer.Option(help="Engine config as JSON.")] = None,
    sha256: Annotated[str | None, typer.Option(help="Expected digest.")] = None,
) -> None:
    """Register a version whose artifact is already in an allowed store location."""
    body = {
        "version": version,
        "artifact_uri": artifact_uri,
        "engine": engine,
        "engine_config": _json_option(engine_config, "--engine-config") or {},
        "sha256": sha256,
    }
    with friendly_errors():
        emit(client().post(f"/v1/models/{name}/versions", body))


@models_app.command("push")
def models_push(
    path: Annotated[
        Path,
        typer.Argument(
            exists=True,
            help="A .safetensors file, or a directory holding one (plus config/tokenizer files).",
        ),
    ],
    name: Annotated[str, typer.Option("--name", "-n")],
    version: Annotated[str, typer.Option("--version", "-v")],
    engine: Annotated[str, typer.Option(help="torch | transformers | vllm")] = "torch",
    engine_config: Annotated[str | None, typer.Option(help="Engine config as JSON.")] = None,
    input_schema: Annotated[str | None, typer.Option(help="Input schema as JSON.")] = None,
    output_schema: Annotated[str | None, typer.Option(help="Output schema as JSON.")] = None,
) -> None:
    """Upload a local artifact to the object store (multipart for large files) and
    register it as NAME:VERSION. Creates the model if needed."""
    from ember.loader.stores import join_uri, open_store

    files, weights = _artifact_files(path)
    settings = load_settings()
    api = client()
    with friendly_errors():
        tenant = api.get("/v1/whoami")["tenant"]
        try:
            api.get(f"/v1/models/{name}/versions/{version}")
            raise Conflict(f"version {version!r} of model {name!r} already exists")
        except NotFound:
            pass
        prefix = join_uri(settings.store_url, "artifacts", tenant, name, version)
        digest = _sha256(weights)
        store = open_store(prefix + "/x", settings)
        total = sum(f.stat().st_size for f in files)
        with Progress(*Progress.get_default_columns()[:1], BarColumn(), DownloadColumn(),
                      TransferSpeedColumn()) as bar:  # fmt: skip
            task = bar.add_task(f"upload {name}:{version}", total=total)
            for file in files:
                rel = file.relative_to(path).as_posix() if path.is_dir() else file.name
                store.put_file(file, join_uri(prefix, rel), lambda n: bar.advance(task, n))
        _ensure_model(api, name)
        rel = weights.relative_to(path).as_posix() if path.is_dir() else weights.name
        body = {
            "version": version,
            "artifact_uri": join_uri(prefix, rel),
            "engine": engine,
            "engine_config": _json_option(engine_config, "--engine-config") or {},
            "input_schema": _json_option(input_schema, "--input-schema"),
            "output_schema": _json_option(output_schema, "--output-schema"),
            "sha256": digest,
        }
        emit(api.post(f"/v1/models/{name}/versions", body))


def _artifact_files(path: Path) -> tuple[list[Path], Path]:
    if path.is_file():
        return [path], path
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    weights = [p for p in files if p.suffix == ".safetensors"]
    if len(weights) != 1:
        raise typer.BadParameter(
            f"{path} must hold exactly one .safetensors file (found {len(weights)})"
        )
    return files, weights[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(8 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def _ensure_model(api: Any, name: str) -> None:
    with contextlib.suppress(Conflict):  # already there: fine
        api.post("/v1/models", {"name": name})


# --- deployments ------------------------------------------------------------------------

POLICY_OPTIONS = ("min_hot", "max_replicas", "target_utilization", "max_batch_size",
                  "max_queue_delay_ms", "timeout_ms", "priority")  # fmt: skip


def _policy(pairs: list[str]) -> dict[str, Any]:
    policy: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in (*POLICY_OPTIONS, "scale_to_zero"):
            raise InvalidInput(f"--set takes KEY=VALUE with KEY in {', '.join(POLICY_OPTIONS)}")
        policy[key] = json.loads(value) if value not in ("", None) else value
    return policy


SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Pool policy KEY=VALUE (repeatable).")
]


@deployments_app.command("create")
def deployments_create(
    model: str,
    version: Annotated[str, typer.Option("--version", "-v", help="The production version.")],
    name: Annotated[str | None, typer.Option(help="Default: the model's name.")] = None,
    fallback: Annotated[list[str] | None, typer.Option(help="Fallback version.")] = None,
    set_: SetOpt = None,
) -> None:
    """Deploy MODEL at VERSION."""
    with friendly_errors():
        body = {"model": model, "version": version, "name": name, "fallback": fallback or [],
                **_policy(set_ or [])}  # fmt: skip
        emit(client().post("/v1/deployments", body))


@deployments_app.command("ls")
def deployments_ls(as_json: JsonOpt = False) -> None:
    """List deployments."""
    with friendly_errors():
        cols = ["name", "model", "traffic", "aliases", "min_hot", "max_replicas", "revision"]
        emit(client().paginate("/v1/deployments"), cols, as_json)


@deployments_app.command("get")
def deployments_get(name: str) -> None:
    """Show a deployment."""
    with friendly_errors():
        emit(client().get(f"/v1/deployments/{name}"))


@deployments_app.command("update")
def deployments_update(name: str, set_: SetOpt = None) -> None:
    """Change pool policy, e.g. `--set min_hot=2`."""
    with friendly_errors():
        emit(client().patch(f"/v1/deployments/{name}", _policy(set_ or [])))


@deployments_app.command("canary")
def deployments_canary(
    name: str,
    version: Annotated[str, typer.Option("--version", "-v")],
    weight: Annotated[int, typer.Option(help="Percent of traffic.")] = 10,
) -> None:
    """Send WEIGHT % of traffic to VERSION."""
    with friendly_errors():
        emit(
            client().post(f"/v1/deployments/{name}:canary", {"version": version, "weight": weight})
        )


@deployments_app.command("promote")
def deployments_promote(
    name: str, version: Annotated[str | None, typer.Option("--version", "-v")] = None
) -> None:
    """Make the canary (or VERSION) production at 100 %."""
    with friendly_errors():
        emit(client().post(f"/v1/deployments/{name}:promote", {"version": version}))


@deployments_app.command("rollback")
def deployments_rollback(name: str) -> None:
    """Drop the canary, or go back to the previous production version."""
    with friendly_errors():
        emit(client().post(f"/v1/deployments/{name}:rollback"))


@deployments_app.command("rm")
def deployments_rm(name: str) -> None:
    """Delete a deployment."""
    with friendly_errors():
        client().delete(f"/v1/deployments/{name}")
        out.print(f"deleted deployment {name}")
