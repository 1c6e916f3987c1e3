"""``ember beat``: run the batch scheduler."""

from __future__ import annotations

from typing import Annotated

import typer

from ember.cli.common import commands, friendly_errors, load_settings

app = commands()


@app.command()
def beat(
    parent_pid: Annotated[
        int | None,
        typer.Option(help="Stop once this process is no longer the parent (`ember up`)."),
    ] = None,
) -> None:
    """Run the batch scheduler: fires due schedules from the registry (changes apply
    without a restart). Run any number: one leads (a Redis lock), and a fire time never
    starts two runs."""
    from ember.batch.beat import run_beat

    settings = load_settings()
    with friendly_errors():
        run_beat(settings, parent_pid)
