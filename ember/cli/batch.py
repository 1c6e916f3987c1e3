"""``ember batch``: schedule, schedules, pause, resume, unschedule, run, status, runs."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ember.cli.common import JsonOpt, client, emit, err, friendly_errors, group

if TYPE_CHECKING:
    from ember.client import EmberClient

app = group("Batch scoring: cron schedules that score whole datasets.")
FINISHED = ("succeeded", "failed")
SCHEDULE_COLUMNS = ["name", "cron", "timezone", "paused", "next_fire_at", "last_fired_at"]
RUN_COLUMNS = ["id", "schedule", "status", "model", "version", "done", "rows", "created_at"]

Model = Annotated[str, typer.Option(help="NAME, NAME:VERSION or NAME:ALIAS.")]
Input = Annotated[
    str, typer.Option("--input", help="file:// or s3:// URI; `{date}` and globs allowed.")
]
Output = Annotated[str, typer.Option("--output", help="Output URI prefix.")]
ShardRows = Annotated[int, typer.Option(help="Rows per shard.")]
Parallel = Annotated[int, typer.Option(help="Shards scored at once.")]
Keys = Annotated[str, typer.Option(help="Key columns copied to the output (comma-separated).")]
Column = Annotated[str, typer.Option(help="The column holding the model input.")]
Format = Annotated[str, typer.Option(help="auto, jsonl, csv or parquet.")]
ErrorRatio = Annotated[float, typer.Option(help="Rejected rows a shard tolerates.")]
Deadline = Annotated[float | None, typer.Option(help="Seconds a run may take.")]


def _spec(
    model: str,
    input_uri: str,
    output_uri: str,
    shard_rows: int,
    parallel: int,
    keys: str,
    column: str,
    fmt: str,
    error_ratio: float,
    deadline: float | None,
) -> dict[str, Any]:
    return {
        "model": model,
        "input_uri": input_uri,
        "output_uri": output_uri,
        "shard_rows": shard_rows,
        "max_parallel_shards": parallel,
        "key_columns": [k.strip() for k in keys.split(",") if k.strip()],
        "input_column": column,
        "format": fmt,
        "max_error_ratio": error_ratio,
        "deadline_s": deadline,
    }


@app.command("schedule")
def batch_schedule(
    name: Annotated[str, typer.Argument(help="The schedule's name.")],
    cron: Annotated[str, typer.Option(help="5-field cron, e.g. '0 2 * * *'.")],
    model: Model,
    input_uri: Input,
    output_uri: Output,
    timezone: Annotated[str, typer.Option(help="IANA time zone.")] = "UTC",
    catch_up: Annotated[str, typer.Option(help="skip, latest or all.")] = "latest",
    shard_rows: ShardRows = 10_000,
    parallel: Parallel = 4,
    keys: Keys = "id",
    column: Column = "features",
    fmt: Annotated[str, typer.Option("--format", help="auto, jsonl, csv or parquet.")] = "auto",
    error_ratio: ErrorRatio = 0.01,
    deadline: Deadline = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a schedule; `ember beat` fires it at each cron time in its zone."""
    body = _spec(
        model,
        input_uri,
        output_uri,
        shard_rows,
        parallel,
        keys,
        column,
        fmt,
        error_ratio,
        deadline,
    ) | {"name": name, "cron": cron, "timezone": timezone, "catch_up": catch_up}
    with friendly_errors():
        emit(client().post("/v1/batch/schedules", body), SCHEDULE_COLUMNS, as_json)


@app.command("schedules")
def batch_schedules(as_json: JsonOpt = False) -> None:
    """List schedules."""
    with friendly_errors():
        emit(client().paginate("/v1/batch/schedules"), SCHEDULE_COLUMNS, as_json)


@app.command("pause")
def batch_pause(name: str, as_json: JsonOpt = False) -> None:
    """Pause a schedule (it does not fire until resumed)."""
    with friendly_errors():
        emit(client().post(f"/v1/batch/schedules/{name}/pause"), SCHEDULE_COLUMNS, as_json)


@app.command("resume")
def batch_resume(name: str, as_json: JsonOpt = False) -> None:
    """Resume a schedule (from its next fire time after now)."""
    with friendly_errors():
        emit(client().post(f"/v1/batch/schedules/{name}/resume"), SCHEDULE_COLUMNS, as_json)


@app.command("unschedule")
def batch_unschedule(name: str) -> None:
    """Delete a schedule (its runs are kept)."""
    with friendly_errors():
        client().delete(f"/v1/batch/schedules/{name}")
        err.print(f"deleted schedule {name}")


@app.command("run")
def batch_run(
    schedule: Annotated[
        str | None, typer.Option(help="Run this schedule now (instead of a spec).")
    ] = None,
    model: Annotated[str | None, typer.Option(help="NAME, NAME:VERSION or NAME:ALIAS.")] = None,
    input_uri: Annotated[str | None, typer.Option("--input", help="Input URI.")] = None,
    output_uri: Annotated[str | None, typer.Option("--output", help="Output prefix.")] = None,
    date: Annotated[str | None, typer.Option(help="`{date}` (YYYY-MM-DD; default today).")] = None,
    shard_rows: ShardRows = 10_000,
    parallel: Parallel = 4,
    keys: Keys = "id",
    column: Column = "features",
    fmt: Annotated[str, typer.Option("--format", help="auto, jsonl, csv or parquet.")] = "auto",
    error_ratio: ErrorRatio = 0.01,
    deadline: Deadline = None,
    wait: Annotated[bool, typer.Option(help="Show a progress bar until it ends.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds --wait waits.")] = 86_400.0,
) -> None:
    """Start a run now: of a schedule (`--schedule`), or ad hoc (`--model --input
    --output`). Prints the run; with `--wait`, a live progress bar first."""
    body: dict[str, Any] = {"date": date}
    if schedule is not None:
        body["schedule"] = schedule
    elif model and input_uri and output_uri:
        body["spec"] = _spec(
            model,
            input_uri,
            output_uri,
            shard_rows,
            parallel,
            keys,
            column,
            fmt,
            error_ratio,
            deadline,
        )
    else:
        raise typer.BadParameter("give --schedule, or all of --model, --input and --output")
    api = client()
    with friendly_errors():
        run = api.post("/v1/batch/runs", body)
        if not wait:
            emit(run, as_json=True)
            return
        err.print(f"started {run['id']} on {run['model']}:{run['version']}")
        _wait(api, run["id"], timeout, 0.5)


@app.command("status")
def batch_status(
    run_id: str,
    wait: Annotated[bool, typer.Option(help="Show a progress bar until it ends.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds --wait waits.")] = 86_400.0,
) -> None:
    """A run with its progress and per-shard errors. Exit status with --wait: 0
    succeeded, 1 failed, 3 still running after --timeout."""
    with friendly_errors():
        if wait:
            _wait(client(), run_id, timeout, 0.5)
        else:
            emit(client().get(f"/v1/batch/runs/{run_id}"), as_json=True)


@app.command("runs")
def batch_runs(
    schedule: Annotated[str | None, typer.Option(help="Only this schedule's runs.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List runs."""
    params = {"schedule": schedule} if schedule else {}
    runs: list[dict[str, Any]] = []
    with friendly_errors():
        api, cursor = client(), None
        while True:
            page = api.get("/v1/batch/runs", limit=100, cursor=cursor, **params)
            runs.extend(page["items"])
            if not (cursor := page["next_cursor"]):
                break
    rows = [
        r
        | {
            "done": f"{r['progress']['shards_done']}/{r['progress']['shards_total']}",
            "rows": r["progress"]["rows_scored"],
        }
        for r in runs
    ]
    emit(rows, RUN_COLUMNS, as_json)


def _describe(run: dict[str, Any]) -> str:
    p = run["progress"]
    text = f"{run['id']} {run['status']}  rows {p['rows_scored']}/{p['rows_total']}"
    if p.get("rows_per_s"):
        text += f"  {p['rows_per_s']:.0f} rows/s"
    if p.get("eta_s") and run["status"] == "running":
        text += f"  ETA {p['eta_s']:.0f}s"
    if p.get("rows_rejected"):
        text += f"  rejected {p['rows_rejected']}"
    return text


def _wait(api: EmberClient, run_id: str, timeout: float, interval: float) -> None:
    deadline = time.monotonic() + timeout
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    run = api.get(f"/v1/batch/runs/{run_id}")
    columns = (
        SpinnerColumn(),
        TextColumn("shards"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(_describe(run), total=run["progress"]["shards_total"] or None)
        while run["status"] not in FINISHED and time.monotonic() < deadline:
            time.sleep(interval)
            run = api.get(f"/v1/batch/runs/{run_id}")
            progress.update(
                task, description=_describe(run), completed=run["progress"]["shards_done"]
            )
    emit(run, as_json=True)
    if run["status"] not in FINISHED:
        err.print(f"[yellow]{run_id} is still {run['status']} after {timeout:g}s[/yellow]")
        raise typer.Exit(3)
    if run["status"] != "succeeded":
        err.print(f"[red]{run_id} failed:[/red] {run.get('error')}")
        raise typer.Exit(1)
