"""Autoscaling policies side by side on real traces (issue 6 targets).

Scenarios (same seed, one run each, every policy on the same arrivals):

- dense: ServeGen language/m-large, all clients aggregated, rescaled to a mean of 20 req/s
  over the 14 days (~24 M requests), 120 s warm-up, SLO wait <= 2 s;
- sparse: every m-large client with a mean below 0.05 req/s as its own model (own
  replicas), at its real rate; Ember and Knative may leave a model with no hot replica;
- bursty: Azure LLM 2023 ``code`` (real timestamps and tokens).

Request sizes: Azure tokens where the trace has them, else drawn (seeded) from Azure
``conv``; cost model ``BENCH_COST_MODEL`` (units = seconds at batch 1, 8 units/s per
replica). Simulation: 1 s ticks with the queue as a fluid, exact per-request FIFO waits
afterwards (see ``ember/pools/simulator.py``). Policies run in parallel on 2 processes.

Promotion times are :class:`~ember.pools.autoscaler.PromotionTimes`' defaults, the ones
``ember simulate`` uses: what ``bench/coldstart.py`` measured for a 1 GiB model (NVMe
cache); every policy sees the same ones. ``max_replicas`` is 200 everywhere: a sparse
client that wakes up can need 25 replicas (ServeGen windows up to 65 req/s), and a cap
below that sheds for every policy alike.

The sparse catalogue is replayed as one simulation (every model in time order): Ember's
models share one pool of standby processes sized causally (one more than the most asked
for within one replacement time so far) and charged for what it holds; a start that
finds it empty waits a cold start.

Prints one table per scenario, then as its LAST line one JSON object. Development runs:
``--quick`` (dense cut to 2 days, sparse and bursty whole), ``--scenario``, ``--policy``,
``--days`` and ``--detail`` (where the SLO misses are: per trace and per minute).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ember.pools.autoscaler import PromotionTimes
from ember.pools.cli import (
    BENCH_COST_MODEL,
    Deployment,
    promotion_line,
    run_catalogue,
    run_policy,
    standby_pool_config,
    table,
)
from ember.pools.simulator import SharedStandby, SimConfig, SimResult, TierCost, catalogue
from ember.pools.traces import (
    Trace,
    default_traces_dir,
    read_azure,
    read_servegen_model,
    servegen_trace,
    size_pool,
)

SEED = 0
#: The measured defaults (bench/coldstart.py, 1 GiB model): warm 0.6, standby 2.5, cold 8 s.
#: Cold is the NVMe-cache figure, the kindest to the cold-start-only peers.
PROMOTION = PromotionTimes()
TIER_COST = TierCost(hot=1.0, warm=0.1, standby=0.03)
#: A standby process put to use is replaced by a new one: spawn + imports, no weights
#: (cold-nvme minus the standby load, ~5.5 s).
STANDBY_POOL = standby_pool_config(PROMOTION)
SIM = SimConfig(cost_model=BENCH_COST_MODEL, promotion=PROMOTION, tier_cost=TIER_COST,
                slo_wait_s=2.0, warmup_s=120.0)  # fmt: skip
SCENARIOS = ("dense", "sparse", "bursty")
#: ``name@u``: that target utilization (Ember and Knative alike, compared at each).
DENSE_POLICIES = ("ember", "ember@0.5", "ember@0.9", "knative", "knative@0.5", "knative@0.9",
                  "ray", "static-peak", "reactive-min1")  # fmt: skip
POLICIES = ("ember", "knative", "ray", "static-peak", "reactive-min1")
SPARSE_DEP = Deployment(min_hot=0, max_replicas=200)
DENSE_DEP = Deployment(min_hot=1, max_replicas=200)
BURSTY_DEP = Deployment(min_hot=1, max_replicas=200)
SCALE_TO_ZERO = ("ember", "knative")
"""Policies that may leave a sparse model with no hot replica (the others keep min 1)."""

_TRACES: dict[str, list[Trace]] = {}


def deployment(scenario: str, policy: str) -> Deployment:
    dep = {"dense": DENSE_DEP, "sparse": SPARSE_DEP, "bursty": BURSTY_DEP}[scenario]
    base, _, util = policy.partition("@")
    if dep.min_hot == 0 and base not in SCALE_TO_ZERO:
        dep = Deployment(min_hot=1, max_replicas=dep.max_replicas)
    if util:
        dep = Deployment(dep.min_hot, dep.max_replicas, float(util), dep.ember)
    return dep


Job = tuple[str, str, list[SimResult], SharedStandby | None, float]


def _job(args: tuple[str, str]) -> Job:
    scenario, policy = args
    t0 = time.perf_counter()
    dep = deployment(scenario, policy)
    traces = _TRACES[scenario]
    if len(traces) == 1:
        results, pool = [run_policy(policy, traces[0], dep, SIM)], None
    else:
        results, pool = run_catalogue(policy, traces, dep, SIM)
    return scenario, policy, results, pool, time.perf_counter() - t0


def load(traces_dir: Path, scenarios: tuple[str, ...], days: dict[str, float | None]) -> None:
    """Fill ``_TRACES`` for ``scenarios``; ``days`` cuts a ServeGen scenario (development)."""
    if "dense" in scenarios or "sparse" in scenarios:
        clients = read_servegen_model(traces_dir / "servegen" / "language" / "m-large")
        sizes = size_pool(traces_dir)
    if "dense" in scenarios:
        dense = servegen_trace(clients, SEED, mean_rps=20.0, sizes=sizes, name="m-large")
        _TRACES["dense"] = [_cut(dense, days.get("dense"))]
    if "sparse" in scenarios:
        sparse = [
            servegen_trace([c], SEED + i, sizes=sizes, name=c.name)
            for i, c in enumerate(clients)
            if c.mean_rps < 0.05
        ]
        _TRACES["sparse"] = [_cut(t, days.get("sparse")) for t in sparse]
    if "bursty" in scenarios:
        _TRACES["bursty"] = [
            read_azure(traces_dir / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv")
        ]


def _cut(tr: Trace, days: float | None) -> Trace:
    if days is None:
        return tr
    m = tr.arrivals_s < days * 86_400
    return Trace(tr.name, tr.arrivals_s[m], tr.input_size[m], tr.output_size[m], days * 86_400)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces-dir", type=Path, default=default_traces_dir())
    ap.add_argument("--scenario", action="append", choices=SCENARIOS,
                    help="run only these (repeat); default all")  # fmt: skip
    ap.add_argument("--policy", action="append", help="run only these policies (repeat)")
    ap.add_argument("--days", type=float, default=None, help="cut ServeGen to N days (dev)")
    ap.add_argument("--quick", action="store_true",
                    help="development run: dense cut to 2 days (sparse, bursty whole)")  # fmt: skip
    ap.add_argument("--detail", action="store_true",
                    help="where the SLO misses are: per trace, per minute")  # fmt: skip
    ap.add_argument("--processes", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    scenarios = tuple(args.scenario or SCENARIOS)
    days: dict[str, float | None] = {"dense": args.days, "sparse": args.days}
    if args.quick and args.days is None:
        days["dense"] = 2.0
    t0 = time.perf_counter()
    load(args.traces_dir, scenarios, days)
    t_load = time.perf_counter() - t0
    jobs = [
        (s, p)
        for s in scenarios
        for p in (DENSE_POLICIES if s == "dense" else POLICIES)
        if not args.policy or p in args.policy
    ]
    # Longest first: the dense jobs dominate.
    jobs.sort(key=lambda j: -sum(len(t) for t in _TRACES[j[0]]))
    with mp.get_context("fork").Pool(args.processes) as pool:
        done = pool.map(_job, jobs, chunksize=1)
    rows: dict[str, dict[str, dict[str, float]]] = {s: {} for s in scenarios}
    per_trace: dict[str, dict[str, list[SimResult]]] = {s: {} for s in scenarios}
    secs: dict[str, float] = {}
    for scenario, policy, results, pool, sec in done:
        if len(results) == 1:
            rows[scenario][policy] = results[0].summary()
        else:  # a catalogue, its standby tier one shared pool (for policies that have one)
            rows[scenario][policy] = catalogue(results, policy, TIER_COST, pool).summary() | {
                "standby_pool": float(pool.largest if pool else 0),
                "standby_asked": float(len(pool.taken_s) + len(pool.empty_s) if pool else 0),
                "standby_empty": float(len(pool.empty_s) if pool else 0),
            }
        per_trace[scenario][policy] = results
        secs[f"{scenario}/{policy}"] = round(sec, 1)
    order = {p: i for i, p in enumerate(DENSE_POLICIES)}
    for s in scenarios:
        rows[s] = dict(sorted(rows[s].items(), key=lambda kv: order.get(kv[0], 99)))
    _print(rows, days, secs, t_load, time.perf_counter() - t0)
    if args.detail:
        for s in scenarios:
            for policy, results in per_trace[s].items():
                print(detail(s, policy, results))
    print(json.dumps(verdict(rows)))


def _print(rows: dict[str, dict[str, dict[str, float]]], days: dict[str, float | None],
           secs: dict[str, float], t_load: float, total: float) -> None:  # fmt: skip
    c = TIER_COST
    print(f"promotion to hot: {promotion_line(PROMOTION)}")
    print(f"tier cost per replica-second: hot {c.hot:g}, warm {c.warm:g}, standby {c.standby:g} "
          f"(configurable); cost model {BENCH_COST_MODEL}")  # fmt: skip

    def span(s: str) -> str:
        d = days.get(s)
        whole = max((t.duration_s for t in _TRACES.get(s, [])), default=0.0) / 86_400
        return f"{whole:.3g} days" if d is None else f"first {d:g} day(s)"

    titles = {
        "dense": f"dense: ServeGen m-large aggregated, mean 20 req/s, {span('dense')}",
        "sparse": f"sparse: m-large clients < 0.05 req/s, one model each, {span('sparse')}",
        "bursty": "bursty: Azure LLM 2023 code",
    }
    for scenario, r in rows.items():
        n = len(_TRACES[scenario])
        print()
        requests = sum(len(t) for t in _TRACES[scenario])
        head = f"{titles[scenario]} ({requests} requests, {n} model(s)), SLO wait <= 2 s"
        print(table(f"{head}, warm-up 120 s", r, "static-peak"))
        if n > 1:
            print(
                "standby is one shared pool of generic processes (the controller's standby "
                "pool), sized as it goes to one more than the most asked for within "
                f"{STANDBY_POOL.replenish_s:g} s so far; "
                + "; ".join(
                    f"{k}: largest {v['standby_pool']:.0f}, asked {v['standby_asked']:.0f} "
                    f"times, empty {v['standby_empty']:.0f}"
                    for k, v in r.items()
                    if v["standby_asked"]
                )
            )
    print(f"\nrun time: traces {t_load:.0f} s, total {total:.0f} s; per job (s): {secs}")


def detail(scenario: str, policy: str, results: list[SimResult], top: int = 8) -> str:
    """Where one policy's SLO misses come from: per trace (catalogue) or per minute."""
    lines = [f"\n{scenario}/{policy}: SLO misses"]
    if len(results) > 1:
        ranked = sorted(results, key=lambda r: -_misses(r).sum())
        total = max(1, sum(int(r.counted.sum()) for r in results))
        lines.append(
            f"  {'trace':10} {'requests':>8} {'missed':>7} {'of all%':>7} {'cold%':>6} "
            f"{'shed%':>6} {'cost':>9} {'hot s':>9} {'warm s':>9} {'standby s':>9}"
        )
        for r in ranked[:top]:
            s = r.summary()
            lines.append(
                f"  {r.trace:10} {s['requests']:8.0f} {int(_misses(r).sum()):7d} "
                f"{100 * _misses(r).sum() / total:7.3f} {s['cold_wait_pct']:6.2f} "
                f"{s['shed_pct']:6.2f} {s['cost']:9.0f} {s['hot_s']:9.0f} {s['warm_s']:9.0f} "
                f"{s['standby_s']:9.0f}"
            )
        return "\n".join(lines)
    r = results[0]
    miss = _misses(r)
    minutes, counts = np.unique((r.arrivals_s[miss] // 60).astype(np.int64), return_counts=True)
    lines.append(f"  {int(miss.sum())} requests in {len(minutes)} minutes; the worst:")
    for k in np.argsort(-counts, kind="stable")[:top]:
        m = minutes[k]
        inside = (r.arrivals_s >= m * 60) & (r.arrivals_s < m * 60 + 60)
        waits = r.wait_s[inside]
        lines.append(
            f"  minute {m:6d} (day {m // 1440}, {m % 1440 // 60:02d}:{m % 60:02d}): "
            f"{counts[k]}/{int(inside.sum())} over, cold {int(r.cold_wait[inside].sum())}, "
            f"shed {int(r.shed[inside].sum())}, max wait {np.nanmax(waits, initial=0):.1f} s"
        )
    return "\n".join(lines)


def _misses(r: SimResult) -> np.ndarray[Any, np.dtype[np.bool_]]:
    out: np.ndarray[Any, np.dtype[np.bool_]] = r.counted & (
        (r.wait_s > r.slo_wait_s + 1e-6) | r.shed
    )
    return out


def better(a: dict[str, float], b: dict[str, float]) -> bool:
    """``a`` beats ``b``: lower cost AND fewer requests over the SLO, both strictly."""
    return a["cost"] < b["cost"] and a["over_slo_pct"] < b["over_slo_pct"]


def verdict(rows: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    """The issue's targets, for the scenarios and policies that ran."""
    out: dict[str, Any] = {}
    d, s, b = rows.get("dense", {}), rows.get("sparse", {}), rows.get("bursty", {})
    if "ember" in d and "static-peak" in d:
        e = d["ember"]
        knatives = {k: v for k, v in d.items() if k.startswith("knative")}
        embers = {k: v for k, v in d.items() if k.startswith("ember")}

        def at(policy: str) -> str:
            return policy.partition("@")[2] or "0.7"

        cost = e["cost"] / d["static-peak"]["cost"]
        out |= {
            "dense_cost_vs_static": round(cost, 4),
            "dense_within_slo": round(100 - e["over_slo_pct"], 4),
            "dense_p999_wait_s": round(e["p999_s"], 3),
            # Ember as deployed (target utilization 0.7, Knative's default too) against
            # every Knative setting tried: lower cost AND fewer SLO misses.
            "dense_beats_knative": {k: better(e, v) for k, v in knatives.items()},
            # ... Ember and Knative at the same target utilization ...
            "dense_beats_knative_same_utilization": {
                f"@{at(k)}": better(embers[m], v)
                for k, v in knatives.items()
                for m in embers
                if at(m) == at(k)
            },
            # ... and, per Knative setting, the Ember settings tried that beat it on both.
            "dense_knative_beaten_by": {
                k: [m for m, mine in embers.items() if better(mine, v)] for k, v in knatives.items()
            },
            "dense_beats_ray": better(e, d["ray"]) if "ray" in d else None,
            "dense_ray_over_slo": round(d["ray"]["over_slo_pct"], 4) if "ray" in d else None,
            "dense_cost_vs_ray": round(e["cost"] / d["ray"]["cost"], 4) if "ray" in d else None,
            # the cost / SLO / tail part of the target alone ...
            "dense_cost_and_slo_met": cost <= 0.40
            and e["over_slo_pct"] <= 0.2
            and e["p999_s"] <= 5.0,
        }
        # ... and the whole target: also better than every Knative setting and Ray at once.
        out["dense_target_met"] = (
            out["dense_cost_and_slo_met"]
            and all(out["dense_beats_knative"].values())
            and out["dense_beats_ray"] is True
        )
    if "ember" in s and "knative" in s:
        ratio = s["ember"]["cost"] / s["knative"]["cost"]
        out |= {
            "sparse_cost_vs_knative": round(ratio, 4),
            "sparse_over_slo": round(s["ember"]["over_slo_pct"], 4),
            "sparse_knative_over_slo": round(s["knative"]["over_slo_pct"], 4),
            "sparse_standby_pool": s["ember"].get("standby_pool"),
            "sparse_standby_empty": s["ember"].get("standby_empty"),
            "sparse_target_met": ratio <= 1.2 and s["ember"]["over_slo_pct"] <= 1.0,
        }
    if "ember" in b:
        cheapest = min(v["cost"] for k, v in b.items() if k != "ember") if len(b) > 1 else None
        within = 100 - b["ember"]["over_slo_pct"]
        out |= {
            "bursty_within_slo": round(within, 4),
            "bursty_cheapest": None if cheapest is None else b["ember"]["cost"] <= cheapest,
            "bursty_target_met": within >= 99.0
            and (cheapest is None or b["ember"]["cost"] <= cheapest),
        }
        if "static-peak" in b:
            out["bursty_cost_vs_static"] = round(b["ember"]["cost"] / b["static-peak"]["cost"], 4)
    return out


if __name__ == "__main__":
    main()
