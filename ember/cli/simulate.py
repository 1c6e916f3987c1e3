"""``ember simulate``: replay a trace against autoscaling policies and print the table
(the policies, runs and table are ``ember.pools.replay``'s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ember.cli.common import commands

app = commands()

# ``ember.pools.autoscaler.PromotionTimes()``'s defaults (bench/coldstart.py's measured
# promotion times), written out so that printing the options does not import the
# autoscaler and with it the registry's schemas; tests/test_cli_package.py keeps them
# equal.
WARM_S = 0.6
STANDBY_S = 2.5
COLD_S = 8.0


@app.command("simulate")
def simulate_command(
    trace: Annotated[
        str,
        typer.Option(
            help="azure:code | azure:conv | servegen:CATEGORY/MODEL "
            "| synthetic | a CSV file | a ServeGen directory"
        ),
    ],
    policy: Annotated[
        list[str] | None,
        typer.Option(
            help="ember[@util], knative[@util], ray[@N], static-peak, reactive-min1, oracle, "
            "knative+cron; repeat, or 'all'"
        ),
    ] = None,
    warmup_s: Annotated[float, typer.Option(help="Requests before this are not counted.")] = 120.0,
    slo_s: Annotated[float, typer.Option(help="Wait SLO in seconds.")] = 2.0,
    seed: Annotated[int, typer.Option()] = 0,
    mean_rps: Annotated[float | None, typer.Option(help="Rescale ServeGen to this mean.")] = None,
    traces_dir: Annotated[Path | None, typer.Option(help="Default: ../shared/traces.")] = None,
    min_hot: Annotated[int, typer.Option()] = 1,
    max_replicas: Annotated[int, typer.Option()] = 100,
    target_utilization: Annotated[float, typer.Option()] = 0.7,
    warm_s: Annotated[
        float, typer.Option(help="Warm -> hot seconds (default: bench/coldstart.py, 1 GiB).")
    ] = WARM_S,
    standby_s: Annotated[
        float, typer.Option(help="Standby -> hot seconds (default: measured, as above).")
    ] = STANDBY_S,
    cold_s: Annotated[
        float, typer.Option(help="Cold -> hot seconds (default: measured, as above).")
    ] = COLD_S,
    warm_cost: Annotated[float, typer.Option(help="Warm cost rate (hot = 1).")] = 0.1,
    standby_cost: Annotated[float, typer.Option(help="Standby cost rate (hot = 1).")] = 0.03,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object too.")] = False,
    profile: Annotated[
        str | None,
        typer.Option(
            help="cpu | gpu-shared | gpu-dedicated: promotion times and tier costs "
            "(instead of the time and cost flags)"
        ),
    ] = None,
) -> None:
    """Replay a trace against autoscaling policies; one table, same seed, one run."""
    from ember.pools.autoscaler import PromotionTimes
    from ember.pools.replay import (
        BENCH_COST_MODEL,
        POLICY_NAMES,
        Deployment,
        load_trace,
        profile_of,
        promotion_line,
        run_policy,
        table,
    )
    from ember.pools.simulator import SimConfig
    from ember.pools.traces import default_traces_dir

    if policy is None:
        policy = ["ember"]
    names = list(POLICY_NAMES) if policy == ["all"] else policy
    tr = load_trace(trace, traces_dir or default_traces_dir(), seed, mean_rps)
    prof = profile_of(profile, PromotionTimes(warm_s, standby_s, cold_s), warm_cost, standby_cost)
    promotion = prof.promotion
    warm_s, standby_s, cold_s = promotion.warm_s, promotion.standby_s, promotion.cold_s
    if profile is None or promotion == PromotionTimes():  # else the profile line says it
        typer.echo(f"promotion to hot: {promotion_line(promotion)}")
    typer.echo(prof.describe())
    sim = SimConfig(
        cost_model=BENCH_COST_MODEL,
        promotion=promotion,
        tier_cost=prof.tier_cost,
        slo_wait_s=slo_s,
        warmup_s=warmup_s,
    )
    dep = Deployment(min_hot, max_replicas, target_utilization)
    rows = {n: run_policy(n, tr, dep, sim).summary() for n in names}
    if "static-peak" not in rows:
        rows["static-peak"] = run_policy("static-peak", tr, dep, sim).summary()
    typer.echo(
        table(
            f"{tr.name}: {len(tr)} requests, {tr.duration_s:.0f} s, SLO wait <= {slo_s:g} s",
            rows,
            "static-peak",
        )
    )
    if as_json:
        times = {"warm_s": warm_s, "standby_s": standby_s, "cold_s": cold_s}
        typer.echo(json.dumps({"promotion": times, "policies": rows}))
