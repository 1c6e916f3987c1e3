"""Replaying traces against autoscaling policies: the policy factory, the runs and the
table that ``ember simulate`` (``ember.cli.simulate``) and ``bench/autoscale.py`` print."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import typer

from ember.costmodel import CostModel
from ember.pools import policies as pol
from ember.pools.autoscaler import (
    PROMOTION_SOURCE,
    Autoscaler,
    EmberConfig,
    EmberState,
    PromotionTimes,
    StandbyPoolConfig,
    decide,
)
from ember.pools.simulator import (
    PROFILES,
    SharedStandby,
    SimConfig,
    SimProfile,
    SimResult,
    TierCost,
    simulate,
    simulate_catalogue,
    unit_costs,
)
from ember.pools.traces import (
    Trace,
    read_azure,
    read_servegen_model,
    servegen_trace,
    size_pool,
    synthetic,
)

POLICY_NAMES = (
    "ember", "knative", "ray", "static-peak", "reactive-min1", "oracle", "knative+cron",
)  # fmt: skip
"""``ember@u`` / ``knative@u`` set the target utilization, ``ray@N`` the target ongoing
requests."""

#: A language model on one accelerator: units are seconds at batch 1 (see costmodel);
#: prefill 5,000 tokens/s, decode 50 tokens/s, 50 ms fixed, 8x throughput at best batch.
BENCH_COST_MODEL = CostModel(alpha=0.0002, beta=0.02, gamma=0.05, capacity_units_per_s=8.0)


@dataclass(frozen=True)
class Deployment:
    """The pool policy fields a deployment would carry, for every policy alike."""

    min_hot: int = 1
    max_replicas: int = 100
    target_utilization: float = 0.7
    ember: dict[str, Any] = field(default_factory=dict)
    """Extra ``EmberConfig`` knobs."""


def peak_hot(trace: Trace, cm: CostModel, utilization: float, window_s: float = 60.0) -> int:
    """Hot replicas for the trace's busiest ``window_s`` at ``utilization`` (static peak)."""
    if len(trace) == 0:
        return 1
    work = unit_costs(cm, trace)
    per_window = np.bincount((trace.arrivals_s // window_s).astype(np.int64), weights=work)
    peak = float(per_window.max()) / window_s
    return max(1, math.ceil(peak / (cm.capacity_units_per_s * utilization) - 1e-9))


def make_autoscaler(
    name: str,
    trace: Trace,
    dep: Deployment,
    cm: CostModel,
    *,
    log_decisions: bool = False,
    sim: SimConfig | None = None,
) -> Autoscaler[Any, Any]:
    """A fresh autoscaler for ``name`` (``knative@0.5`` sets KPA's target utilization,
    ``ray@8`` Ray's target ongoing requests). ``sim`` gives the tier costs Ember's policy
    weighs and what the oracle and the cron floor plan with (default: ``SimConfig()``)."""

    def clock() -> float:
        return 0.0  # the simulator passes ``now`` on every step

    kw: dict[str, Any] = {"clock": clock, "log_decisions": log_decisions, "model": trace.name}
    sim = sim or SimConfig(cost_model=cm)
    base, _, arg = name.partition("@")
    util = float(arg) if arg and base in ("ember", "knative", "knative+cron") else None
    if util is not None:
        dep = Deployment(dep.min_hot, dep.max_replicas, util, dep.ember)
    if base == "ember":
        cfg = EmberConfig(
            min_hot=dep.min_hot,
            scale_to_zero=dep.min_hot == 0,
            max_replicas=dep.max_replicas,
            target_utilization=dep.target_utilization,
            **({"warm_cost": sim.tier_cost.warm / sim.tier_cost.hot,
                "standby_cost": sim.tier_cost.standby / sim.tier_cost.hot} | dep.ember),
        )  # fmt: skip
        return Autoscaler(decide, cfg, EmberState(), **kw)
    if base in ("knative", "knative+cron"):
        kcfg = pol.KnativeConfig(target_utilization=util or 0.7, max_scale=dep.max_replicas)
        if base == "knative":
            return Autoscaler(pol.knative, kcfg, pol.KnativeState(), **kw)
        floor = pol.cron_floor(hourly_units(trace, cm), cm.capacity_units_per_s, util or 0.7)
        ccfg = pol.CronFloorConfig(kcfg, floor, lead_s=sim.promotion.cold_s)
        return Autoscaler(pol.knative_cron, ccfg, pol.KnativeState(), **kw)
    if base == "ray":
        rcfg = pol.RayConfig(max_replicas=dep.max_replicas)
        if arg:
            rcfg = pol.RayConfig(target_ongoing_requests=float(arg), max_replicas=dep.max_replicas)
        return Autoscaler(pol.ray, rcfg, pol.RayState(), **kw)
    if base == "oracle":
        ocfg = oracle_config(trace, cm, sim, dep.min_hot)
        return Autoscaler(pol.oracle, ocfg, None, **kw)
    if base == "static-peak":
        scfg = pol.StaticConfig(hot=peak_hot(trace, cm, dep.target_utilization))
        return Autoscaler(pol.static, scfg, None, **kw)
    if base == "reactive-min1":
        qcfg = pol.ReactiveConfig(
            target_utilization=dep.target_utilization, max_replicas=dep.max_replicas
        )
        return Autoscaler(pol.reactive, qcfg, pol.ReactiveState(), **kw)
    raise typer.BadParameter(f"unknown policy {name!r}; one of {', '.join(POLICY_NAMES)}")


def hourly_units(trace: Trace, cm: CostModel) -> list[float]:
    """Mean demand (units/s) per hour of the day over the trace: the profile a user
    schedules a cron floor from."""
    if len(trace) == 0 or trace.duration_s <= 0:
        return [0.0] * 24
    hour = ((trace.arrivals_s % 86_400.0) // 3600.0).astype(np.int64)
    units = np.bincount(hour, weights=unit_costs(cm, trace), minlength=24)
    days = max(trace.duration_s / 86_400.0, 1.0 / 24)
    return [float(u) / (3600.0 * days) for u in units[:24]]


def oracle_config(trace: Trace, cm: CostModel, sim: SimConfig, min_hot: int) -> pol.OracleConfig:
    """The clairvoyant plan for ``trace``: per tick, the work arriving within one SLO wait."""
    nbins = math.ceil(trace.duration_s / sim.tick_s) + 1
    ticks = (trace.arrivals_s // sim.tick_s).astype(np.int64)
    units = np.bincount(ticks, weights=unit_costs(cm, trace), minlength=nbins)
    return pol.oracle_plan(
        units.tolist(), cm.capacity_units_per_s, cold_s=sim.promotion.cold_s,
        slo_wait_s=sim.slo_wait_s, tick_s=sim.tick_s, min_hot=min_hot,
    )  # fmt: skip


def run_policy(name: str, trace: Trace, dep: Deployment, sim: SimConfig) -> SimResult:
    scaler = make_autoscaler(name, trace, dep, sim.cost_model, sim=sim)
    return simulate(trace, scaler, sim, policy_name=name)


STANDBY_POLICIES = ("ember",)
"""Policies with a standby tier: in a catalogue they share one pool of standby processes
(Knative and Ray start pods from nothing)."""


def standby_pool_config(promotion: PromotionTimes) -> StandbyPoolConfig:
    """The shared standby pool for these promotion times: a process put to use is replaced
    by a new one in a cold start less the weight load."""
    return StandbyPoolConfig(replenish_s=max(promotion.cold_s - promotion.standby_s, 0.0))


def run_catalogue(
    name: str, traces: Sequence[Trace], dep: Deployment, sim: SimConfig
) -> tuple[list[SimResult], SharedStandby | None]:
    """Every trace as its own model, all replayed together; a policy with a standby tier
    shares one causally sized standby pool across them."""
    scalers = [make_autoscaler(name, tr, dep, sim.cost_model, sim=sim) for tr in traces]
    shared = name.partition("@")[0] in STANDBY_POLICIES
    pool = standby_pool_config(sim.promotion) if shared else None
    return simulate_catalogue(traces, scalers, sim, standby=pool, policy_name=name)


def table(title: str, rows: dict[str, dict[str, float]], reference: str | None) -> str:
    """One row per policy; cost as a fraction of ``reference`` (static peak) when given."""
    ref = rows[reference]["cost"] if reference and reference in rows else None
    head = (f"{'policy':15} {'cost':>12} {'vs static':>9} {'hot s':>11} {'warm s':>11} "
            f"{'standby s':>11} {'cold-wait%':>10} {'>SLO%':>7} {'shed%':>6} "
            f"{'p50 s':>7} {'p99 s':>7} {'p99.9 s':>8}")  # fmt: skip
    lines = [title, head, "-" * len(head)]
    for name, s in rows.items():
        frac = f"{s['cost'] / ref:9.3f}" if ref else f"{'-':>9}"
        lines.append(
            f"{name:15} {s['cost']:12.0f} {frac} {s['hot_s']:11.0f} {s['warm_s']:11.0f} "
            f"{s['standby_s']:11.0f} {s['cold_wait_pct']:10.3f} {s['over_slo_pct']:7.3f} "
            f"{s['shed_pct']:6.3f} {s['p50_s']:7.3f} {s['p99_s']:7.3f} {s['p999_s']:8.3f}"
        )
    return "\n".join(lines)


def load_trace(spec: str, traces_dir: Path, seed: int, mean_rps: float | None) -> Trace:
    """``azure:code``, ``azure:conv``, ``servegen:language/m-large``, ``synthetic``, a CSV
    file (Azure format) or a ServeGen model directory."""
    kind, _, arg = spec.partition(":")
    if kind == "azure":
        return read_azure(traces_dir / "azure-llm-2023" / f"AzureLLMInferenceTrace_{arg}.csv")
    if kind == "servegen":
        clients = read_servegen_model(traces_dir / "servegen" / arg)
        return servegen_trace(clients, seed, mean_rps=mean_rps, sizes=size_pool(traces_dir),
                              name=arg)  # fmt: skip
    if kind == "synthetic":
        return synthetic(seed, 6 * 3600.0, mean_rps or 10.0, period_s=3600.0, bursts=4)
    path = Path(spec)
    if path.is_dir():
        clients = read_servegen_model(path)
        return servegen_trace(clients, seed, mean_rps=mean_rps, sizes=size_pool(traces_dir),
                              name=path.name)  # fmt: skip
    if path.is_file():
        return read_azure(path)
    raise typer.BadParameter(f"no trace {spec!r}")


def profile_of(
    name: str | None, promotion: PromotionTimes, warm_cost: float, standby_cost: float
) -> SimProfile:
    if name is None:
        return SimProfile("custom", promotion, TierCost(1.0, warm_cost, standby_cost), "flags")
    if name not in PROFILES:
        raise typer.BadParameter(f"unknown profile {name!r}; one of {', '.join(PROFILES)}")
    return PROFILES[name]


def promotion_line(promotion: PromotionTimes) -> str:
    """The promotion times used and where they come from, for the output."""
    source = PROMOTION_SOURCE if promotion == PromotionTimes() else "set by flags"
    return f"{promotion.describe()} ({source})"
