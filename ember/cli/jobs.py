"""``ember jobs``: submit, get, list, cancel, wait, result, secret."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ember.cli.common import JsonOpt, client, emit, err, friendly_errors, group, load_settings, out
from ember.errors import InvalidInput

if TYPE_CHECKING:
    from ember.client import EmberClient

app = group("Async jobs: submit work, come back for the result.")
JOB_COLUMNS = [
    "id",
    "model",
    "version",
    "status",
    "instances",
    "attempt_count",
    "created_at",
    "finished_at",
]
FINISHED = ("succeeded", "failed", "cancelled")
INLINE_INPUT_MAX = 1024 * 1024
"""``--input`` files up to this size are sent in the request; larger ones are uploaded to
the object store (``job-inputs/<tenant>/``) and passed as ``input_uri``."""


def _instances_option(value: str) -> list[Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"--instances is not valid JSON: {exc.msg}") from exc
    if not isinstance(parsed, list) or not parsed:
        raise typer.BadParameter("--instances must be a non-empty JSON list")
    return parsed


def _upload_input(api: EmberClient, path: Path) -> str:
    from ember.jobs.results import input_prefix
    from ember.loader.stores import join_uri, open_store

    settings = load_settings()
    tenant = api.get("/v1/whoami")["tenant"]
    # The object's name: the file's, with anything but letters, digits, '.', '_' and '-'
    # replaced (a '?', '#' or '%' in a URI is refused), its extension (the format) kept.
    name = re.sub(r"[^A-Za-z0-9._-]", "_", path.name)[-120:]
    uri = join_uri(input_prefix(settings, tenant), f"{uuid.uuid4().hex[:12]}-{name}")
    open_store(uri, settings).put_file(path, uri)
    return uri


@app.command("submit")
def jobs_submit(
    model: Annotated[str, typer.Argument(help="NAME, NAME:VERSION or NAME:ALIAS.")],
    instances: Annotated[
        str | None, typer.Option(help="Instances as a JSON list, e.g. '[[0.1, 0.2]]'.")
    ] = None,
    input_file: Annotated[
        Path | None,
        typer.Option(
            "--input",
            exists=True,
            dir_okay=False,
            help='A JSON file {"instances": [...]}; large files go through the object store.',
        ),
    ] = None,
    priority: Annotated[int, typer.Option(min=0, max=9, help="0-9, higher first.")] = 5,
    webhook: Annotated[str | None, typer.Option(help="URL POSTed when the job ends.")] = None,
    idempotency_key: Annotated[str | None, typer.Option(help="Idempotency-Key.")] = None,
    wait: Annotated[bool, typer.Option(help="Wait for the job to finish.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds --wait waits.")] = 3600.0,
    as_json: JsonOpt = False,
) -> None:
    """Submit a job; prints it (its `id` is what `get`, `wait` and `cancel` take)."""
    if (instances is None) == (input_file is None):
        raise typer.BadParameter("give exactly one of --instances and --input")
    body: dict[str, Any] = {"model": model, "priority": priority, "webhook_url": webhook}
    api = client()
    with friendly_errors():
        if instances is not None:
            body["inputs"] = {"instances": _instances_option(instances)}
        elif input_file is not None and input_file.stat().st_size <= INLINE_INPUT_MAX:
            try:
                body["inputs"] = json.loads(input_file.read_bytes())
            except (ValueError, UnicodeDecodeError) as exc:
                raise InvalidInput(f"{input_file} is not valid JSON: {exc}") from exc
        elif input_file is not None:
            body["input_uri"] = _upload_input(api, input_file)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        job = api.post("/v1/jobs", body, headers=headers)
        if not wait:
            emit(job, as_json=True)
            return
        err.print(f"submitted {job['id']}")
        _wait(api, job["id"], timeout, 0.5)


@app.command("get")
def jobs_get(job_id: str) -> None:
    """Show a job: status, attempts, version, result (inline) or its URI and digest."""
    with friendly_errors():
        emit(client().get(f"/v1/jobs/{job_id}"))


@app.command("list")
def jobs_list(
    status: Annotated[
        str | None, typer.Option(help="queued | running | succeeded | failed | cancelled")
    ] = None,
    model: Annotated[str | None, typer.Option(help="Only this model's jobs.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List your jobs (oldest first)."""
    with friendly_errors():
        api = client()
        items: list[Any] = []
        cursor: str | None = None
        while True:
            page = api.get("/v1/jobs", limit=200, cursor=cursor, status=status, model=model)
            items.extend(page["items"])
            cursor = page["next_cursor"]
            if not cursor:
                break
        emit(items, JOB_COLUMNS, as_json)


@app.command("cancel")
def jobs_cancel(job_id: str) -> None:
    """Cancel a queued or running job."""
    with friendly_errors():
        job = client().delete(f"/v1/jobs/{job_id}")
        out.print(f"cancelled {job['id']} (was running: {job['started_at'] is not None})")


@app.command("wait")
def jobs_wait(
    job_id: str,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 3600.0,
    interval: Annotated[float, typer.Option(help="Seconds between polls.")] = 0.5,
) -> None:
    """Wait for a job to finish, showing its progress; prints the job. Exit status: 0
    succeeded, 1 failed or cancelled, 3 still unfinished after --timeout."""
    with friendly_errors():
        _wait(client(), job_id, timeout, interval)


def _describe(job: dict[str, Any]) -> str:
    text = f"{job['id']} {job['status']}"
    if job.get("version"):
        text += f" on {job['model']}:{job['version']}"
    text += f"  attempt {job['attempt_count']}/{job['max_attempts']}"
    if job.get("deferrals"):
        text += f"  deferred {job['deferrals']}x (online first)"
    if job["status"] == "queued" and job.get("next_attempt_at"):
        text += f"  next try {job['next_attempt_at']}"
    last = [a for a in job.get("attempts", []) if a.get("error")]
    if last and job["status"] in ("queued", "running"):
        text += f"  last error: {last[-1]['error'][:80]}"
    return text


def _wait(api: EmberClient, job_id: str, timeout: float, interval: float) -> None:
    deadline = time.monotonic() + timeout
    job = api.get(f"/v1/jobs/{job_id}")
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(_describe(job), total=None)
        while job["status"] not in FINISHED and time.monotonic() < deadline:
            time.sleep(interval)
            job = api.get(f"/v1/jobs/{job_id}")
            progress.update(task, description=_describe(job))
    emit(job, as_json=True)
    if job["status"] not in FINISHED:
        err.print(f"[yellow]{job_id} is still {job['status']} after {timeout:g}s[/yellow]")
        raise typer.Exit(3)
    if job["status"] != "succeeded":
        err.print(f"[red]{job_id} {job['status']}:[/red] {job.get('error')}")
        raise typer.Exit(1)


@app.command("result")
def jobs_result(
    job_id: str,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write it here.")] = None,
) -> None:
    """A succeeded job's result JSON (inline or from the object store), checked against
    its sha256."""
    import hashlib  # OpenSSL's bindings: not on the way of ``ember --help``

    with friendly_errors():
        response = client().download(f"/v1/jobs/{job_id}/result")
        digest = hashlib.sha256(response.content).hexdigest()
        expected = response.headers.get("x-ember-result-sha256")
        if expected and digest != expected:
            raise InvalidInput(f"the result's sha256 {digest} is not the job's {expected}")
        if output is None:
            out.print_json(response.text)
        else:
            output.write_bytes(response.content)
            err.print(f"wrote {len(response.content)} bytes to {output} (sha256 {digest})")


@app.command("secret")
def jobs_secret(
    rotate: Annotated[bool, typer.Option(help="Replace it with a new one.")] = False,
) -> None:
    """Your tenant's webhook signing secret."""
    with friendly_errors():
        api = client()
        row = api.post("/v1/webhooks/secret:rotate") if rotate else api.get("/v1/webhooks/secret")
        emit(row)
