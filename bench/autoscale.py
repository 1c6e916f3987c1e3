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

Prints one table per scenario, then as its LAST line one JSON object.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ember.pools.autoscaler import PromotionTimes
from ember.pools.cli import (
    BENCH_COST_MODEL,
    Deployment,
    combine,
    run_policy,
    table,
)
from ember.pools.simulator import SimConfig, SimResult, TierCost
from ember.pools.traces import (
    Trace,
    default_traces_dir,
    read_azure,
    read_servegen_model,
    servegen_trace,
    size_pool,
)

SEED = 0
PROMOTION = PromotionTimes(warm_s=2.0, standby_s=5.0, cold_s=30.0)
TIER_COST = TierCost(hot=1.0, warm=0.1, standby=0.03)
SIM = SimConfig(cost_model=BENCH_COST_MODEL, promotion=PROMOTION, tier_cost=TIER_COST,
                slo_wait_s=2.0, warmup_s=120.0)  # fmt: skip
DENSE_POLICIES = ("ember", "knative", "knative@0.5", "knative@0.9", "ray", "static-peak",
                  "reactive-min1")  # fmt: skip
POLICIES = ("ember", "knative", "ray", "static-peak", "reactive-min1")
SPARSE_DEP = Deployment(min_hot=0, max_replicas=8)
DENSE_DEP = Deployment(min_hot=1, max_replicas=200)
BURSTY_DEP = Deployment(min_hot=1, max_replicas=50)

_TRACES: dict[str, list[Trace]] = {}


def _job(args: tuple[str, str]) -> tuple[str, str, SimResult, float]:
    scenario, policy = args
    t0 = time.perf_counter()
    dep = {"dense": DENSE_DEP, "sparse": SPARSE_DEP, "bursty": BURSTY_DEP}[scenario]
    if scenario == "sparse" and policy in ("ray", "reactive-min1"):
        dep = Deployment(min_hot=1, max_replicas=8)
    results = [run_policy(policy, tr, dep, SIM) for tr in _TRACES[scenario]]
    res = results[0] if len(results) == 1 else combine(results, policy)
    return scenario, policy, res, time.perf_counter() - t0


def load(traces_dir: Path, days: float | None) -> None:
    clients = read_servegen_model(traces_dir / "servegen" / "language" / "m-large")
    sizes = size_pool(traces_dir)
    dense = servegen_trace(clients, SEED, mean_rps=20.0, sizes=sizes, name="m-large")
    sparse = [
        servegen_trace([c], SEED + i, sizes=sizes, name=c.name)
        for i, c in enumerate(clients)
        if c.mean_rps < 0.05
    ]
    if days is not None:  # a shorter run for development
        dense, sparse = _cut(dense, days), [_cut(t, days) for t in sparse]
    _TRACES["dense"] = [dense]
    _TRACES["sparse"] = sparse
    _TRACES["bursty"] = [
        read_azure(traces_dir / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv")
    ]


def _cut(tr: Trace, days: float) -> Trace:
    m = tr.arrivals_s < days * 86_400
    return Trace(tr.name, tr.arrivals_s[m], tr.input_size[m], tr.output_size[m], days * 86_400)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces-dir", type=Path, default=default_traces_dir())
    ap.add_argument("--days", type=float, default=None, help="cut ServeGen to N days (dev)")
    ap.add_argument("--processes", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    t0 = time.perf_counter()
    load(args.traces_dir, args.days)
    t_load = time.perf_counter() - t0
    jobs = [("dense", p) for p in DENSE_POLICIES]
    jobs += [(s, p) for s in ("sparse", "bursty") for p in POLICIES]
    with mp.get_context("fork").Pool(args.processes) as pool:
        done = pool.map(_job, jobs, chunksize=1)
    rows: dict[str, dict[str, dict[str, float]]] = {"dense": {}, "sparse": {}, "bursty": {}}
    secs: dict[str, float] = {}
    for scenario, policy, res, sec in done:
        rows[scenario][policy] = res.summary()
        secs[f"{scenario}/{policy}"] = round(sec, 1)
    _print(rows, secs, t_load, time.perf_counter() - t0)


def _print(rows: dict[str, dict[str, dict[str, float]]], secs: dict[str, float],
           t_load: float, total: float) -> None:  # fmt: skip
    p, c = PROMOTION, TIER_COST
    print(f"promotion to hot: hot 0 s, warm {p.warm_s:g} s (host-to-device copy, ~1 GiB), "
          f"standby {p.standby_s:g} s (stream from NVMe ~1.5 GB/s), cold {p.cold_s:g} s "
          f"(spawn + imports + load); configurable (--warm-s ... in `ember simulate`)")  # fmt: skip
    print(f"tier cost per replica-second: hot {c.hot:g}, warm {c.warm:g}, standby {c.standby:g} "
          f"(configurable); cost model {BENCH_COST_MODEL}")  # fmt: skip
    titles = {
        "dense": "dense: ServeGen m-large aggregated, mean 20 req/s, 14 days",
        "sparse": f"sparse: {len(_TRACES['sparse'])} m-large clients < 0.05 req/s, one model each",
        "bursty": "bursty: Azure LLM 2023 code",
    }
    for scenario, title in titles.items():
        n = len(_TRACES[scenario])
        print()
        print(table(f"{title} ({sum(len(t) for t in _TRACES[scenario])} requests, {n} model(s)), "
                    "SLO wait <= 2 s, warm-up 120 s", rows[scenario], "static-peak"))  # fmt: skip
    print(f"\nrun time: traces {t_load:.0f} s, total {total:.0f} s; per job (s): {secs}")
    print(json.dumps(verdict(rows)))


def verdict(rows: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    d, s, b = rows["dense"], rows["sparse"], rows["bursty"]
    e = d["ember"]

    def beats(other: dict[str, float]) -> bool:
        return e["cost"] < other["cost"] and e["over_slo_pct"] < other["over_slo_pct"]

    knatives = [v for k, v in d.items() if k.startswith("knative")]
    cheapest = min(v["cost"] for v in b.values())
    return {
        "dense_cost_vs_static": round(e["cost"] / d["static-peak"]["cost"], 4),
        "dense_within_slo": round(100 - e["over_slo_pct"], 4),
        "dense_p999_wait_s": round(e["p999_s"], 3),
        "dense_beats_knative": all(beats(k) for k in knatives),
        "dense_beats_ray": beats(d["ray"]),
        "dense_target_met": e["cost"] / d["static-peak"]["cost"] <= 0.40
        and e["over_slo_pct"] <= 0.2
        and e["p999_s"] <= 5.0,
        "sparse_cost_vs_knative": round(s["ember"]["cost"] / s["knative"]["cost"], 4),
        "sparse_over_slo": round(s["ember"]["over_slo_pct"], 4),
        "sparse_knative_over_slo": round(s["knative"]["over_slo_pct"], 4),
        "bursty_within_slo": round(100 - b["ember"]["over_slo_pct"], 4),
        "bursty_cheapest": b["ember"]["cost"] <= cheapest,
        "bursty_cost_vs_static": round(b["ember"]["cost"] / b["static-peak"]["cost"], 4),
    }


if __name__ == "__main__":
    main()
