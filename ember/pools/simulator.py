"""Trace simulator: replay arrivals against tiered replicas driven by an :class:`Autoscaler`.

The model (stated, because it is an approximation):

- A model's hot replicas form one pool that serves FIFO at ``hot x capacity`` model
  units/s (the engine's batching is folded into the calibrated capacity: a replica does
  ``capacity_units_per_s`` at its best batch). A request needs ``cost`` units of it.
  A request's **wait** is the time from its arrival until the pool starts its work; a
  request that arrives with no hot replica waits for a promotion ("cold-start wait").
- Time advances in ticks of ``tick_s`` (1 s). Promotions finish mid-tick at their exact
  time. The autoscaler is called every tick, at the first arrival that finds no hot
  replica (like Knative's activator, so a request never waits for the next tick), and
  skips idle stretches when the policy says nothing can change before its
  ``next_eval_s``.
- The tick loop keeps the queue as a fluid (for the observations and admission); the
  exact per-request start times are computed afterwards, vectorised, in "capacity time"
  ``tau(t) = integral of capacity``: FIFO start ``s_i = W_i + max_{j<=i}(tau(a_j) - W_j)``
  with ``W`` the work ahead, mapped back through ``tau``. Exact for the pooled server.
- Admission: arrivals in a tick are shed (429) when the predicted wait at the tick's start
  exceeds ``max_wait_s``. Every request ends served or shed, exactly once.
- Tiers: a promotion comes from warm, then standby, then cold. Demotion is instant; a
  start still in progress is cancelled before a ready replica is demoted. Replicas cost
  ``hot`` while promoting.
- Catalogues (many models, each its own simulation): :func:`catalogue` charges the
  standby tier as one pool of generic processes shared by all models, sized so that
  none ever finds it empty (:func:`shared_standby_pool`), as the pools controller runs it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ember.costmodel import CostModel
from ember.pools.autoscaler import Autoscaler, Observation, PromotionTimes, TierCounts
from ember.pools.traces import Trace

FloatArray = npt.NDArray[np.float64]
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class TierCost:
    """Cost per replica-second in each tier (hot = one accelerator)."""

    hot: float = 1.0
    warm: float = 0.1
    standby: float = 0.03


@dataclass(frozen=True, slots=True)
class SimConfig:
    cost_model: CostModel = field(default_factory=CostModel)
    promotion: PromotionTimes = field(default_factory=PromotionTimes)
    tier_cost: TierCost = field(default_factory=TierCost)
    slo_wait_s: float = 2.0
    warmup_s: float = 120.0
    tick_s: float = 1.0
    max_wait_s: float = 30.0
    drain_limit_s: float = 3_600.0


@dataclass
class SimResult:
    """Per-request outcome plus the replica-seconds each tier cost (after warm-up)."""

    policy: str
    arrivals_s: FloatArray
    wait_s: FloatArray
    """NaN where shed."""
    shed: npt.NDArray[np.bool_]
    cold_wait: npt.NDArray[np.bool_]
    replica_s: dict[str, float]
    weighted_cost: float
    decisions: int
    slo_wait_s: float
    warmup_s: float
    trace: str = ""
    duration_s: float = 0.0
    standby_takes_s: FloatArray = field(default_factory=lambda: np.zeros(0))
    """When a standby process was put to use (promoted, or loaded to warm)."""

    @property
    def counted(self) -> npt.NDArray[np.bool_]:
        mask: npt.NDArray[np.bool_] = self.arrivals_s >= self.warmup_s
        return mask

    def summary(self) -> dict[str, float]:
        m = self.counted
        n = int(m.sum())
        waits = self.wait_s[m & ~self.shed]
        over = int(((self.wait_s[m] > self.slo_wait_s + 1e-6) | self.shed[m]).sum())
        q = np.quantile(waits, [0.5, 0.99, 0.999]) if len(waits) else np.full(3, math.nan)
        return {
            "requests": float(n),
            "cost": self.weighted_cost,
            "hot_s": self.replica_s["hot"],
            "warm_s": self.replica_s["warm"],
            "standby_s": self.replica_s["standby"],
            "cold_wait_pct": 100.0 * float(self.cold_wait[m].sum()) / max(n, 1),
            "over_slo_pct": 100.0 * over / max(n, 1),
            "shed_pct": 100.0 * float(self.shed[m].sum()) / max(n, 1),
            "p50_s": float(q[0]),
            "p99_s": float(q[1]),
            "p999_s": float(q[2]),
        }


class _Pool:
    """Replica inventory of one model: counts per tier plus in-flight transitions."""

    def __init__(self, promo: PromotionTimes) -> None:
        self.promo = promo
        self.hot = 0
        self.warm = 0
        self.standby = 0
        self.promoting: list[tuple[float, str]] = []  # heap of (ready time, from tier)
        self.standby_takes: list[float] = []  # when a standby process was put to use
        self.creating: list[tuple[float, str, str]] = []  # heap of (ready time, tier, from)

    def counts_for_cost(self) -> tuple[int, int, int]:
        cw = sum(1 for e in self.creating if e[1] == "warm")
        cs = len(self.creating) - cw
        return self.hot + len(self.promoting), self.warm + cw, self.standby + cs

    def next_event(self) -> float:
        a = self.promoting[0][0] if self.promoting else math.inf
        b = self.creating[0][0] if self.creating else math.inf
        return min(a, b)

    def complete(self, now: float) -> None:
        while self.promoting and self.promoting[0][0] <= now + _EPS:
            heapq.heappop(self.promoting)
            self.hot += 1
        while self.creating and self.creating[0][0] <= now + _EPS:
            _, tier, _src = heapq.heappop(self.creating)
            if tier == "warm":
                self.warm += 1
            else:
                self.standby += 1

    def apply(self, want: TierCounts, now: float) -> None:
        p = self.promo
        have = self.hot + len(self.promoting)
        for _ in range(want.hot - have):
            if self.warm:
                self.warm -= 1
                heapq.heappush(self.promoting, (now + p.warm_s, "warm"))
            elif self.standby:
                self.standby -= 1
                self.standby_takes.append(now)
                heapq.heappush(self.promoting, (now + p.standby_s, "standby"))
            else:
                heapq.heappush(self.promoting, (now + p.cold_s, "cold"))
        for _ in range(have - want.hot):
            if self.promoting:  # cancel the promotion that would finish last
                last = max(self.promoting)
                self.promoting.remove(last)
                heapq.heapify(self.promoting)
                if last[1] == "warm":
                    self.warm += 1
                elif last[1] == "standby":
                    self.standby += 1
            else:
                self.hot -= 1
                self.warm += 1
        self._fill("warm", want.warm, now)
        self._fill("standby", want.standby, now)

    def _fill(self, tier: str, want: int, now: float) -> None:
        p = self.promo
        pending = sum(1 for e in self.creating if e[1] == tier)
        have = (self.warm if tier == "warm" else self.standby) + pending
        for _ in range(want - have):
            if tier == "warm" and self.standby:
                self.standby -= 1
                self.standby_takes.append(now)
                ready = now + max(p.standby_s - p.warm_s, 0.0)
                heapq.heappush(self.creating, (ready, tier, "standby"))
            else:
                load = p.cold_s if tier == "warm" else max(p.cold_s - p.standby_s, 0.0)
                heapq.heappush(self.creating, (now + load, tier, "cold"))
        for _ in range(have - want):
            if any(e[1] == tier for e in self.creating):
                # Cancel the start that would finish last before touching a ready replica.
                last = max(e for e in self.creating if e[1] == tier)
                self.creating.remove(last)
                heapq.heapify(self.creating)
                if last[2] == "standby":
                    self.standby += 1
            elif tier == "warm":
                self.warm -= 1
                self.standby += 1
            else:
                self.standby -= 1


def unit_costs(cm: CostModel, trace: Trace) -> FloatArray:
    """Each request's cost in model units (``CostModel.cost``, vectorised)."""
    out: FloatArray = cm.alpha * trace.input_size + cm.beta * trace.output_size + cm.gamma
    return out


def simulate(
    trace: Trace,
    autoscaler: Autoscaler[Any, Any],
    config: SimConfig,
    *,
    policy_name: str = "",
) -> SimResult:
    """Replay ``trace`` through ``autoscaler``; see the module docstring for the model."""
    cm = config.cost_model
    a = trace.arrivals_s
    w = unit_costs(cm, trace) if len(a) else np.zeros(0)
    loop = _Loop(trace, w, autoscaler, config)
    loop.run()
    res = loop.result(policy_name)
    res.trace = trace.name
    res.duration_s = trace.duration_s
    res.standby_takes_s = np.asarray(loop.pool.standby_takes, dtype=np.float64)
    return res


class _Loop:
    def __init__(
        self, trace: Trace, work: FloatArray, autoscaler: Autoscaler[Any, Any], cfg: SimConfig
    ) -> None:
        self.cfg = cfg
        self.a = trace.arrivals_s
        self.work = work
        self.scaler = autoscaler
        self.end_s = trace.duration_s
        self.cap = cfg.cost_model.capacity_units_per_s
        self.mean_cost = float(work.mean()) if len(work) else 1.0
        tick = cfg.tick_s
        nbins = math.ceil(self.end_s / tick) + 1
        self.bin_of = np.minimum((self.a // tick).astype(np.int64), nbins - 1)
        self.bin_lo = np.searchsorted(self.bin_of, np.arange(nbins + 1)).tolist()
        self.bin_units = np.bincount(self.bin_of, weights=work, minlength=nbins).tolist()
        self.busy_bins = np.flatnonzero(np.bincount(self.bin_of, minlength=nbins)).tolist()
        self.nbins = nbins
        self.pool = _Pool(cfg.promotion)
        self.shed = np.zeros(len(self.a), dtype=bool)
        self.t_grid: list[float] = [0.0]
        self.tau_grid: list[float] = [0.0]
        self.rates: list[float] = []
        self.cost_s = {"hot": 0.0, "warm": 0.0, "standby": 0.0}
        self.backlog = 0.0
        self.served = 0.0
        self.arrived = 0.0
        self.admitted = 0.0
        self.last_eval = 0.0
        self.next_eval = 0.0
        self.decisions = 0

    # -- time and capacity

    def _advance(self, t0: float, t1: float) -> float:
        """Move from t0 to t1 (no decisions in between); return capacity-work done."""
        done = 0.0
        t = t0
        while t < t1 - _EPS:
            seg_end = min(t1, self.pool.next_event())
            seg_end = max(seg_end, t)
            self._account(t, seg_end)
            rate = self.pool.hot * self.cap
            done += rate * (seg_end - t)
            if seg_end > t:
                self.rates.append(rate)
                self.tau_grid.append(self.tau_grid[-1] + rate * (seg_end - t))
                self.t_grid.append(seg_end)
            t = seg_end
            self.pool.complete(t)
        return done

    def _account(self, t0: float, t1: float) -> None:
        lo = max(t0, self.cfg.warmup_s)
        hi = min(t1, self.end_s)
        if hi <= lo:
            return
        hot, warm, standby = self.pool.counts_for_cost()
        self.cost_s["hot"] += hot * (hi - lo)
        self.cost_s["warm"] += warm * (hi - lo)
        self.cost_s["standby"] += standby * (hi - lo)

    # -- decisions

    def _decide(self, now: float) -> None:
        dt = max(now - self.last_eval, _EPS)
        served_rate = self.served / dt
        p = self.pool
        obs = Observation(
            interval_s=dt,
            arrived_units_per_s=self.arrived / dt,
            admitted_units_per_s=self.admitted / dt,
            inflight_units=served_rate * self.mean_cost,
            queued_units=self.backlog,
            capacity_units_per_s=self.cap,
            ready=TierCounts(p.hot, p.warm, p.standby),
            promoting=len(p.promoting),
            promotion=self.cfg.promotion,
            # Little's law with a request's batch-1 latency = its cost in seconds.
            inflight_requests=served_rate,
            queued_requests=self.backlog / self.mean_cost,
        )
        decision = self.scaler.step(obs, now)
        self.decisions += 1
        p.apply(decision.desired, now)
        self.next_eval = decision.next_eval_s
        self.last_eval = now
        self.served = self.arrived = self.admitted = 0.0

    def _predicted_wait(self, now: float) -> float:
        if self.pool.hot:
            return self.backlog / (self.pool.hot * self.cap)
        if self.pool.promoting:
            return self.pool.promoting[0][0] - now + self.backlog / self.cap
        return math.inf

    # -- main loop

    def run(self) -> None:
        tick = self.cfg.tick_s
        self._decide(0.0)
        self.pool.complete(math.inf)  # deployed before the trace starts
        self.pool.promoting.clear()
        k = 0
        busy_i = 0
        limit = self.end_s + self.cfg.drain_limit_s
        while True:
            t = k * tick
            if t >= self.end_s and self.backlog <= _EPS and not self.pool.promoting:
                break
            if t >= limit:
                break
            k = self._skip_idle(k, busy_i)
            t = k * tick
            while busy_i < len(self.busy_bins) and self.busy_bins[busy_i] < k:
                busy_i += 1
            self._tick(k, t, t + tick)
            k += 1

    def _skip_idle(self, k: int, busy_i: int) -> int:
        tick = self.cfg.tick_s
        if self.backlog > _EPS or self.pool.promoting or self.pool.creating:
            return k
        if k < self.nbins and self.bin_lo[k + 1] > self.bin_lo[k]:
            return k
        nxt_busy = self.busy_bins[busy_i] if busy_i < len(self.busy_bins) else self.nbins
        while nxt_busy < k and busy_i < len(self.busy_bins):
            busy_i += 1
            nxt_busy = self.busy_bins[busy_i] if busy_i < len(self.busy_bins) else self.nbins
        wake = self.next_eval
        # A tick decides at its end: wake in the tick that ends at or after ``wake``.
        wake_k = math.ceil(wake / tick - _EPS) - 1 if wake < math.inf else self.nbins
        target = min(nxt_busy, wake_k)
        target = min(target, self.nbins)
        if target <= k + 1:
            return k
        self._advance(k * tick, target * tick)
        return target

    def _tick(self, k: int, t0: float, t1: float) -> None:
        lo, hi = (self.bin_lo[k], self.bin_lo[k + 1]) if k < self.nbins else (0, 0)
        units = self.bin_units[k] if k < self.nbins else 0.0
        t = t0
        rest = units  # arrived units not yet reported to the autoscaler
        if hi > lo and self.pool.hot == 0 and not self.pool.promoting:
            first = float(self.a[lo])  # activator: decide at the first arrival
            done = self._advance(t0, first)
            self.served += min(done, self.backlog)
            self.backlog = max(0.0, self.backlog - done)
            self.arrived += float(self.work[lo])
            rest -= float(self.work[lo])
            self._decide(first)
            t = first
        if hi > lo:
            self.arrived += rest
            if self._predicted_wait(t) > self.cfg.max_wait_s:
                self.shed[lo:hi] = True
                units = 0.0
            self.admitted += units
        done = self._advance(t, t1)
        total = self.backlog + units
        self.served += min(done, total)
        self.backlog = max(0.0, total - done)
        if t1 >= self.next_eval - _EPS or hi > lo or self.backlog > _EPS or self.pool.promoting:
            self._decide(t1)

    # -- results

    def result(self, name: str) -> SimResult:
        n = len(self.a)
        wait = np.full(n, np.nan)
        cold = np.zeros(n, dtype=bool)
        t_grid = np.asarray(self.t_grid)
        tau_grid = np.asarray(self.tau_grid)
        rates = np.asarray([*self.rates, 0.0])
        adm = np.flatnonzero(~self.shed)
        if len(adm):
            a = self.a[adm]
            w = self.work[adm]
            ahead = np.concatenate([[0.0], np.cumsum(w)[:-1]])
            tau_a = np.interp(a, t_grid, tau_grid)
            start_tau = ahead + np.maximum.accumulate(tau_a - ahead)
            seg = np.searchsorted(tau_grid, start_tau, side="right") - 1
            unserved = seg >= len(tau_grid) - 1
            seg_c = np.minimum(seg, len(rates) - 1)
            rate = np.where(rates[seg_c] > 0, rates[seg_c], 1.0)
            start = (
                t_grid[np.minimum(seg, len(t_grid) - 1)]
                + (start_tau - tau_grid[np.minimum(seg, len(tau_grid) - 1)]) / rate
            )
            served_wait = np.maximum(start - a, 0.0)
            wait[adm] = np.where(unserved, np.nan, served_wait)
            self.shed[adm[unserved]] = True  # still queued when the drain limit hit
            seg_a = np.clip(np.searchsorted(t_grid, a, side="right") - 1, 0, len(rates) - 1)
            cold[adm] = rates[seg_a] <= 0
        tc = self.cfg.tier_cost
        weighted = (
            tc.hot * self.cost_s["hot"]
            + tc.warm * self.cost_s["warm"]
            + tc.standby * self.cost_s["standby"]
        )
        return SimResult(
            policy=name,
            arrivals_s=self.a,
            wait_s=wait,
            shed=self.shed,
            cold_wait=cold,
            replica_s=dict(self.cost_s),
            weighted_cost=weighted,
            decisions=self.decisions,
            slo_wait_s=self.cfg.slo_wait_s,
            warmup_s=self.cfg.warmup_s,
        )


def shared_standby_pool(results: Sequence[SimResult], replenish_s: float) -> int:
    """Generic standby processes a catalogue needs so that none of its models ever finds
    the pool empty: the most standby processes put to use within any ``replenish_s``
    (a used process is replaced by spawning a new one: interpreter and imports, no
    weights). At least one when any model uses the tier."""
    takes = np.sort(np.concatenate([r.standby_takes_s for r in results] or [np.zeros(0)]))
    uses = any(r.replica_s["standby"] > 0 for r in results)
    if len(takes) == 0:
        return 1 if uses else 0
    ends = np.searchsorted(takes, takes + replenish_s - _EPS, side="left")
    return int((ends - np.arange(len(takes))).max())


def catalogue(
    results: Sequence[SimResult], name: str, tier_cost: TierCost, *, replenish_s: float
) -> tuple[SimResult, int]:
    """Many models' results as one catalogue whose standby tier is one shared pool.

    Standby processes hold no weights (DESIGN.md: "standby processes are generic"; the
    pools controller keeps one pool for every deployment), so a catalogue pays for the
    pool it needs (:func:`shared_standby_pool`), not for a standby replica per model.
    Returns the combined result and the pool size.
    """
    pool = shared_standby_pool(results, replenish_s)
    first = results[0]
    counted = max((r.duration_s for r in results), default=0.0) - first.warmup_s
    replica_s = {k: sum(r.replica_s[k] for r in results) for k in first.replica_s}
    replica_s["standby"] = pool * max(counted, 0.0)
    weighted = (
        tier_cost.hot * replica_s["hot"]
        + tier_cost.warm * replica_s["warm"]
        + tier_cost.standby * replica_s["standby"]
    )
    cat = np.concatenate
    out = SimResult(
        policy=name,
        arrivals_s=cat([r.arrivals_s for r in results]),
        wait_s=cat([r.wait_s for r in results]),
        shed=cat([r.shed for r in results]),
        cold_wait=cat([r.cold_wait for r in results]),
        replica_s=replica_s,
        weighted_cost=weighted,
        decisions=sum(r.decisions for r in results),
        slo_wait_s=first.slo_wait_s,
        warmup_s=first.warmup_s,
        trace="catalogue",
        duration_s=counted + first.warmup_s,
        standby_takes_s=np.sort(cat([r.standby_takes_s for r in results])),
    )
    return out, pool
