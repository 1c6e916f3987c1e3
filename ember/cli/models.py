"""``ember models``: models and versions, and pushing artifacts (thin commands over the
HTTP API; a push writes to the object store itself, then registers)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.filesize import decimal

from ember.cli.common import JsonOpt, client, emit, err, friendly_errors, group, load_settings, out
from ember.errors import (
    Conflict,
    EmberError,
    Forbidden,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    Unauthenticated,
)

if TYPE_CHECKING:
    from ember.config import Settings
    from ember.loader.upload import LocalFile, Push

app = group("Models and versions.")

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


@app.command("create")
def models_create(name: str, description: str = "", as_json: JsonOpt = False) -> None:
    """Create a model."""
    with friendly_errors():
        emit(client().post("/v1/models", {"name": name, "description": description}), as_json=True)


@app.command("ls")
def models_ls(as_json: JsonOpt = False) -> None:
    """List models."""
    with friendly_errors():
        cols = ["name", "version_count", "latest_version", "created_at"]
        emit(client().paginate("/v1/models"), cols, as_json)


@app.command("get")
def models_get(name: str) -> None:
    """Show a model."""
    with friendly_errors():
        emit(client().get(f"/v1/models/{name}"))


@app.command("rm")
def models_rm(name: str) -> None:
    """Delete a model and its versions (refused while a deployment serves it)."""
    with friendly_errors():
        client().delete(f"/v1/models/{name}")
        out.print(f"deleted model {name}")


@app.command("versions")
def models_versions(name: str, as_json: JsonOpt = False) -> None:
    """List a model's versions."""
    with friendly_errors():
        emit(client().paginate(f"/v1/models/{name}/versions"), VERSION_COLUMNS, as_json)


@app.command("register")
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


EngineConfigOpt = Annotated[str | None, typer.Option(help="Engine config as JSON.")]
InputSchemaOpt = Annotated[str | None, typer.Option(help="Input schema as JSON.")]
OutputSchemaOpt = Annotated[str | None, typer.Option(help="Output schema as JSON.")]
WaitOpt = Annotated[
    bool, typer.Option("--wait", help="Wait until the server has validated the version.")
]
DeleteOpt = Annotated[
    bool,
    typer.Option(
        "--delete-on-refusal",
        help="Delete the uploaded files if the registration is refused (default: keep "
        "them, so a corrected re-run sends nothing again).",
    ),
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Check and list the files; upload nothing.")
]


@app.command("push")
def models_push(
    path: Annotated[
        Path,
        typer.Argument(
            exists=True,
            help="A .safetensors file, or a checkpoint directory (shards, index, config, "
            "tokenizer files).",
        ),
    ],
    name: Annotated[str, typer.Option("--name", "-n")],
    version: Annotated[str, typer.Option("--version", "-v")],
    engine: Annotated[str, typer.Option(help="torch | transformers | vllm")] = "torch",
    engine_config: EngineConfigOpt = None,
    input_schema: InputSchemaOpt = None,
    output_schema: OutputSchemaOpt = None,
    wait: WaitOpt = False,
    delete_on_refusal: DeleteOpt = False,
    dry_run: DryRunOpt = False,
) -> None:
    """Upload a local artifact to the object store and register it as NAME:VERSION
    (the model is created if needed).

    A **file** is registered as that one file (the server takes the config and tokenizer
    files it finds beside it). A **directory** is registered whole, as one manifest
    version: every file but hidden ones goes under `artifacts/<tenant>/NAME/VERSION/`,
    after the directory passed the registry's own checks here (layout, every shard's
    header, the index against the shards), so a bad one is refused before a byte is sent.

    Large files go to S3 as parallel multipart uploads (EMBER_S3_PART_SIZE_BYTES,
    EMBER_S3_MAX_CONCURRENCY). An interrupted push (Ctrl-C, a network failure, a killed
    process) resumes when run again with the same arguments: files already in the store
    are skipped, and the parts of an unfinished upload are kept (state in
    `~/.cache/ember/uploads/`)."""
    from ember.loader.upload import check_header, check_local, list_directory, local_file

    settings = load_settings()
    with friendly_errors():
        if path.is_dir():
            files = list_directory(path, max_files=settings.manifest_max_files)
            check_local(files, settings.artifact_max_header_bytes)
        else:
            files = [local_file(path)]
            check_header(files[0], settings.artifact_max_header_bytes)
        body = _version_body(version, engine, engine_config, input_schema, output_schema)
        _push(settings, files, name, body, directory=path.is_dir(), wait=wait,
              delete_on_refusal=delete_on_refusal, dry_run=dry_run)  # fmt: skip


@app.command("import-hf")
def models_import_hf(
    source: Annotated[
        str,
        typer.Argument(
            metavar="PATH",
            help="A save_pretrained directory, a hub cache entry (models--org--name/), one "
            "of its snapshots, or a repo id (org/name) in the local hub cache.",
        ),
    ],
    name: Annotated[str, typer.Option("--name", "-n")],
    version: Annotated[str, typer.Option("--version", "-v")],
    revision: Annotated[
        str | None,
        typer.Option(help="A cache entry's ref or commit (default: what refs/main names)."),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            help="torch | transformers | vllm (default: vllm for a causal LM in "
            "config.json's architectures, else transformers)."
        ),
    ] = None,
    engine_config: EngineConfigOpt = None,
    input_schema: InputSchemaOpt = None,
    output_schema: OutputSchemaOpt = None,
    wait: WaitOpt = False,
    delete_on_refusal: DeleteOpt = False,
    dry_run: DryRunOpt = False,
) -> None:
    """Push a Hugging Face model that is already on this machine and register it as
    NAME:VERSION, exactly as `models push DIR` does. Nothing reaches a hub: download the
    model into the cache first (`huggingface-cli download org/name`).

    The cache's links are resolved, and only into that entry's own `blobs/` (a link
    elsewhere is refused). Kept: the safetensors weights the index lists, config,
    tokenizer, generation and chat-template files. Left out, each named with the reason:
    pickles (`.bin`, `.pt`, `.pth`: unpickling runs arbitrary code; a model whose only
    weights are pickles is refused), Python files, shards the index does not list (e.g.
    `consolidated.safetensors`), other formats."""
    from ember.loader import hf_import
    from ember.loader.upload import check_local

    settings = load_settings()
    with friendly_errors():
        found = hf_import.locate(source, revision)
        picked = hf_import.select(hf_import.files_of(found, settings.manifest_max_files),
                                  found.label)  # fmt: skip
        err.print(f"importing {found.label}: {len(picked.files)} files")
        for left, why in picked.left_out:
            err.print(f"  left out {left}: {why}")
        config = _json_option(engine_config, "--engine-config")
        if engine is None:
            engine, chosen, why = hf_import.default_engine(picked.config)
            config = chosen if config is None else config
            err.print(f"  engine: {engine} ({why}; --engine to choose another)")
        check_local(picked.files, settings.artifact_max_header_bytes)
        body = _version_body(version, engine, None, input_schema, output_schema)
        body["engine_config"] = config or {}
        _push(settings, picked.files, name, body, directory=True, wait=wait,
              delete_on_refusal=delete_on_refusal, dry_run=dry_run)  # fmt: skip


def _version_body(
    version: str,
    engine: str,
    engine_config: str | None,
    input_schema: str | None,
    output_schema: str | None,
) -> dict[str, Any]:
    """The registration (its engine config is checked in ``_push``)."""
    config = _json_option(engine_config, "--engine-config") or {}
    return {
        "version": version,
        "engine": engine,
        "engine_config": config,
        "input_schema": _json_option(input_schema, "--input-schema"),
        "output_schema": _json_option(output_schema, "--output-schema"),
    }


def _check_engine(engine: str, config: dict[str, Any]) -> None:
    """What the server's schema will check of the engine and its config, checked before
    the upload (a typo should not cost an upload); the code it names is the server's
    to allow (``ember.domain.trust``)."""
    from ember.registry.schemas import KNOWN_ENGINES, check_engine_config

    if engine not in KNOWN_ENGINES:
        raise InvalidInput(f"--engine must be one of {', '.join(KNOWN_ENGINES)}")
    try:
        check_engine_config(engine, config)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def _push(
    settings: Settings,
    files: list[LocalFile],
    name: str,
    body: dict[str, Any],
    *,
    directory: bool,
    wait: bool,
    delete_on_refusal: bool,
    dry_run: bool,
) -> None:
    """Hash, upload (``ember.loader.upload``) and register ``files`` as ``name``."""
    from ember.domain.manifest import Manifest
    from ember.loader.stores import join_uri, open_store
    from ember.loader.upload import Push, object_uri, user_cache_dir
    from ember.logs import model_context

    version = body["version"]
    if dry_run:
        _check_engine(body["engine"], body["engine_config"])
        emit([{"path": f.path, "size_bytes": f.size} for f in files], ["path", "size_bytes"])
        err.print(f"{len(files)} files, {decimal(sum(f.size for f in files))}: nothing uploaded")
        return
    api = client()
    tenant = api.get("/v1/whoami")["tenant"]
    try:
        api.get(f"/v1/models/{name}/versions/{version}")
        raise Conflict(f"version {version!r} of model {name!r} already exists")
    except NotFound:
        pass
    _check_engine(body["engine"], body["engine_config"])
    prefix = join_uri(settings.store_url, "artifacts", tenant, name, version)
    push = Push(open_store(prefix + "/x", settings), settings,
                state_dir=user_cache_dir() / "uploads")  # fmt: skip
    with model_context(name, version):
        files = _upload(push, files, prefix, f"{name}:{version}")
        if directory:  # the version is the manifest: its digest is the expected sha256
            body["artifact_uri"] = prefix + "/"
            body["sha256"] = Manifest.of(f.entry() for f in files).digest
        else:
            body["artifact_uri"] = object_uri(prefix, files[0].path, push.store)
            body["sha256"] = files[0].sha256
        _ensure_model(api, name)
        try:
            row = api.post(f"/v1/models/{name}/versions", body)
        except EmberError as exc:
            _refused(exc, push, files, prefix, delete_on_refusal)
            raise
        if wait and row.get("status") == "pending":
            row = _wait_validated(api, name, version)
        emit(row)
        if row.get("status") == "pending":
            err.print("the server validates it in the background (status pending until it "
                      "has hashed every file): --wait waits for that")  # fmt: skip
        if row.get("status") == "failed":
            err.print(f"validation failed: {_left_in(files, prefix)}")
            raise typer.Exit(1)


def _upload(push: Push, files: list[LocalFile], prefix: str, what: str) -> list[LocalFile]:
    """Hash and upload with a progress bar over all bytes; on an interruption or a
    failure, say what reached the store and how to resume."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from ember.loader.upload import digest_files, user_cache_dir

    total = sum(f.size for f in files)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())  # fmt: skip
    try:
        with Progress(*columns, console=err) as bar:
            hashing = bar.add_task(f"hash {what}", total=total)
            files = digest_files(files, progress=lambda n: bar.advance(hashing, n),
                                 cache_dir=user_cache_dir(), cancel=push.cancel)  # fmt: skip
            sending = bar.add_task(f"upload {what}", total=total)
            push.progress = lambda n: bar.advance(sending, n)
            push.run(files, prefix)
    except KeyboardInterrupt:
        push.cancel.set()
        err.print(f"[yellow]interrupted[/yellow]: {_summary(push)}; nothing is registered. "
                  "Run the same command again to resume.")  # fmt: skip
        raise typer.Exit(130) from None
    except EmberError:
        err.print(f"{_summary(push)}; nothing is registered. Run the same command again to "
                  "resume: what is already in the store is not sent again.")  # fmt: skip
        raise
    err.print(_summary(push))
    return files


def _summary(push: Push) -> str:
    r = push.report
    done = [f"uploaded {len(r.uploaded)} files ({decimal(r.bytes_sent)}"
            + (f", {r.parts_sent} parts)" if r.parts_sent else ")")]  # fmt: skip
    if r.skipped:
        done.append(f"skipped {len(r.skipped)} already in the store")
    if r.parts_kept:
        done.append(f"kept {r.parts_kept} parts of an interrupted upload")
    if r.aborted_uploads:
        done.append(f"aborted {r.aborted_uploads} stale multipart uploads")
    return ", ".join(done)


def _left_in(files: list[LocalFile], prefix: str) -> str:
    size = decimal(sum(f.size for f in files))
    return f"the {len(files)} files of this push ({size}) stay in the store under {prefix}/"


def _refused(
    exc: EmberError, push: Push, files: list[LocalFile], prefix: str, delete: bool
) -> None:
    """The upload is done and the registration refused: say what stays where, or, with
    ``--delete-on-refusal`` and a definite refusal, delete it — never after a conflict
    (the version is someone else's now), a transport error or a 5xx (it may have been
    registered). Kept by default because most refusals (an engine config, a trust policy,
    a quota) are fixed by running again with other options, and then nothing is sent
    again."""
    left = _left_in(files, prefix)
    if isinstance(exc, Conflict):
        err.print(f"registration refused (registered meanwhile?): {left}")
    elif not isinstance(exc, InvalidInput | Forbidden | Unauthenticated | PayloadTooLarge):
        err.print(f"the registration did not go through, or its answer was lost (check "
                  f"`ember models versions`): {left}; run the same command again to retry "
                  "without uploading again")  # fmt: skip
    elif delete:
        removed = push.delete(files, prefix)
        err.print(f"registration refused: deleted the {removed} files of this push from "
                  f"{prefix}/")  # fmt: skip
    else:
        err.print(f"registration refused: {left}. Run the command again with corrected "
                  "options to register them without uploading again, or add "
                  "--delete-on-refusal to remove them.")  # fmt: skip


def _wait_validated(api: Any, name: str, version: str) -> Any:
    with err.status(f"validating {name}:{version} (the server hashes every file)"):
        while True:
            row = api.get(f"/v1/models/{name}/versions/{version}")
            if row.get("status") != "pending":
                return row
            time.sleep(1.0)


def _ensure_model(api: Any, name: str) -> None:
    with contextlib.suppress(Conflict):  # already there: fine
        api.post("/v1/models", {"name": name})
