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
- Tiers: the policy's counts are carried out by the pools controller's own rules
  (:mod:`ember.pools.plan`): a promotion comes from warm, then a warm spare still
  loading, then standby, then cold; a ready hot replica over the target is demoted while
  warm is short, else stopped; a start on its way beyond the target is cancelled first
  (a promotion from warm is not). Demotion is instant. Replicas cost ``hot`` while promoting.
- Catalogues (many models): :func:`simulate_catalogue` replays every model together, in
  time order, against one :class:`SharedStandby` pool of generic processes (no weights), as
  the pools controller keeps it. A model's standby floor is a claim on that pool, not a
  process of its own: the start that uses the claim (its wake-up) takes a ready process (a
  standby load) or, when the pool is empty, waits a cold start; other starts are cold. The
  pool is sized causally (:func:`~ember.pools.autoscaler.size_standby_pool`: one more than
  the most processes asked for within one replacement time so far) and charged for the
  processes it holds, ready or spawning.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ember.costmodel import CostModel
from ember.domain.spec import Source, Tier
from ember.pools.autoscaler import (
    Autoscaler,
    Observation,
    PromotionTimes,
    StandbyPoolConfig,
    StandbyPoolState,
    TierCounts,
    size_standby_pool,
)
from ember.pools.plan import Actions, Inventory, Target, all_ready, hot_target, plan
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
class SimProfile:
    """Named hardware assumptions: promotion times and tier costs (printed with every
    table, since the headline figures depend on both)."""

    name: str
    promotion: PromotionTimes
    tier_cost: TierCost
    source: str

    def describe(self) -> str:
        c = self.tier_cost
        return (
            f"profile {self.name}: promotion {self.promotion.describe()}; cost per "
            f"replica-second hot {c.hot:g}, warm {c.warm:g}, standby {c.standby:g} ({self.source})"
        )


_GPU_TIMES = PromotionTimes(warm_s=2.0, standby_s=20.0, cold_s=120.0)
PROFILES: dict[str, SimProfile] = {
    "cpu": SimProfile(
        "cpu",
        PromotionTimes(),
        TierCost(1.0, 0.1, 0.03),
        "bench/coldstart.py, 1 GiB model on CPU; released host memory serves other models",
    ),
    "gpu-shared": SimProfile(
        "gpu-shared",
        _GPU_TIMES,
        TierCost(1.0, 0.1, 0.03),
        "GPU cold starts are minutes (Ray Serve 8B from zero 71-104 s); a catalogue "
        "hands released devices to other models, so warm and standby cost a fraction",
    ),
    "gpu-dedicated": SimProfile(
        "gpu-dedicated",
        _GPU_TIMES,
        TierCost(1.0, 1.0, 1.0),
        "the same times; a warm or standby replica keeps its device: full charge",
    ),
}
"""``cpu``, ``gpu-shared``, ``gpu-dedicated`` (``ember simulate --profile``, the bench)."""


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
    fill_warm: bool = True
    """Start warm spares (``EMBER_SCALE_FILL_WARM``); without, warm holds only demoted
    replicas."""
    hot_floor: int = 0
    """The deployment's hot floor (``PoolPolicy.hot_floor``) and most replicas, as the
    pools controller applies them around the policy's figure."""
    max_replicas: int = 1_000_000
    record_plans: bool = False
    """Keep every step's observation, inventory and actions (:attr:`SimResult.plans`)."""


@dataclass(frozen=True)
class PlanStep:
    """One autoscaler step of a replay: what it saw, wanted and did."""

    at: float
    observation: Observation
    desired: TierCounts
    inventory: Inventory
    target: Target
    actions: Actions


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
    plans: list[PlanStep] = field(default_factory=list)
    """With ``SimConfig.record_plans``: every step."""

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


class SharedStandby:
    """A catalogue's pool of generic standby processes, sized causally and charged for
    what it holds (see :func:`~ember.pools.autoscaler.size_standby_pool`)."""

    def __init__(self, cfg: StandbyPoolConfig) -> None:
        self.cfg = cfg
        self.state = StandbyPoolState()
        self.ready_at: list[float] = [-math.inf] * cfg.size(self.state)
        """Per process: when it is (or was) ready; a taken one is replaced at once."""
        self.sizes: list[tuple[float, int]] = [(-math.inf, len(self.ready_at))]
        self.taken_s: list[float] = []
        self.empty_s: list[float] = []
        """When a start found no ready process (and waited a cold start instead)."""

    def ready(self, now: float) -> int:
        return sum(1 for t in self.ready_at if t <= now + _EPS)

    def take(self, now: float) -> bool:
        """A start asks for a process at ``now``: True when one was ready (it is replaced
        by a new one, ready ``replenish_s`` later). The pool learns from the ask either way."""
        size, self.state = size_standby_pool(self.state, self.cfg, now)
        if size > len(self.ready_at):
            self.ready_at += [now + self.cfg.replenish_s] * (size - len(self.ready_at))
            self.sizes.append((now, size))
        first = min(range(len(self.ready_at)), key=self.ready_at.__getitem__)
        if self.ready_at[first] > now + _EPS:
            self.empty_s.append(now)
            return False
        self.ready_at[first] = now + self.cfg.replenish_s
        self.taken_s.append(now)
        return True

    def held_s(self, t0: float, t1: float) -> float:
        """Process-seconds the pool held over ``[t0, t1]`` (ready or spawning)."""
        steps = sorted(self.sizes)
        total = 0.0
        for (at, size), (nxt, _) in zip(steps, [*steps[1:], (math.inf, 0)], strict=True):
            lo, hi = max(at, t0), min(nxt, t1)
            if hi > lo:
                total += size * (hi - lo)
        return total

    @property
    def largest(self) -> int:
        return max(size for _, size in self.sizes)


class _Pool:
    """Replica inventory of one model: counts per tier plus in-flight transitions.

    With ``shared`` (a catalogue), the model holds no standby process of its own: its
    ``standby`` count is the policy's standby floor as claims on the shared pool, set at
    once and free. A start that holds a claim asks the pool (a standby load if a process
    is ready, else a cold start); other starts are cold starts, as in a pool sized for
    wake-ups they would mostly be."""

    def __init__(self, promo: PromotionTimes) -> None:
        self.promo = promo
        self.hot = 0
        self.warm = 0
        self.standby = 0
        self.shared: SharedStandby | None = None
        self.promoting: list[tuple[float, Source]] = []  # heap of (ready time, from)
        self.standby_takes: list[float] = []  # when a standby process was put to use
        self.creating: list[tuple[float, Tier, Source]] = []  # (ready time, tier, from)

    def counts_for_cost(self) -> tuple[int, int, int]:
        cw = sum(1 for e in self.creating if e[1] is Tier.warm)
        cs = len(self.creating) - cw
        own = self.standby if self.shared is None else 0  # claims are the pool's to charge
        return self.hot + len(self.promoting), self.warm + cw, own + cs

    def ready_standby(self, now: float) -> int:
        if self.shared is None:
            return self.standby
        return min(self.standby, self.shared.ready(now))

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
            if tier is Tier.warm:
                self.warm += 1
            else:
                self.standby += 1

    def _take_standby(self, now: float) -> bool:
        if not self.standby:
            return False
        self.standby -= 1
        took = self.shared.take(now) if self.shared is not None else True
        if took:
            self.standby_takes.append(now)
        return took

    def inventory(self) -> Inventory:
        return Inventory(
            hot=self.hot,
            warm=self.warm,
            starting_hot=len(self.promoting),
            promoting=sum(1 for e in self.promoting if e[1] is Source.warm),
            starting_warm=sum(1 for e in self.creating if e[1] is Tier.warm),
        )

    def apply(self, want: TierCounts, now: float, cfg: SimConfig) -> tuple[Target, Actions]:
        """Carry out the policy's tier counts as the pools controller does: the same
        :func:`~ember.pools.plan.hot_target` and :func:`~ember.pools.plan.plan`, acted on
        this model of time (demotion instant)."""
        p = self.promo
        hot = hot_target(
            want.hot, floor=cfg.hot_floor, weight=100, production=True, woken=False,
            max_replicas=cfg.max_replicas,
        )  # fmt: skip
        target = Target(hot, want.warm)
        ready = all_ready({"v": hot}, {"v": self.hot})
        acts = plan(self.inventory(), target, fill_warm=cfg.fill_warm, may_retire=ready)
        for _ in range(acts.promote):
            self.warm -= 1
            heapq.heappush(self.promoting, (now + p.warm_s, Source.warm))
        for _ in range(acts.keep_hot):  # the warm spare loading soonest stays hot
            first = min(e for e in self.creating if e[1] is Tier.warm)
            self.creating.remove(first)
            heapq.heapify(self.creating)
            heapq.heappush(self.promoting, (first[0], first[2]))
        for _ in range(acts.start_hot):
            if self._take_standby(now):
                heapq.heappush(self.promoting, (now + p.standby_s, Source.standby))
            else:
                heapq.heappush(self.promoting, (now + p.cold_s, Source.cold))
        for _ in range(acts.start_warm):
            if self._take_standby(now):
                ready_at = now + max(p.standby_s - p.warm_s, 0.0)
                heapq.heappush(self.creating, (ready_at, Tier.warm, Source.standby))
            else:
                heapq.heappush(self.creating, (now + p.cold_s, Tier.warm, Source.cold))
        for _ in range(acts.cancel_hot):  # the start that would be ready last
            start = max(e for e in self.promoting if e[1] is not Source.warm)
            self.promoting.remove(start)
            heapq.heapify(self.promoting)
            if start[1] is Source.standby and self.shared is None:
                self.standby += 1
        for _ in range(acts.stop_starting):  # the warm spare that would be ready last
            last = max(e for e in self.creating if e[1] is Tier.warm)
            self.creating.remove(last)
            heapq.heapify(self.creating)
            if last[2] is Source.standby and self.shared is None:
                self.standby += 1
        self.hot -= acts.demote + acts.stop_hot
        self.warm += acts.demote - acts.stop_warm
        if self.shared is None:
            self._fill_standby(want.standby, now)
        else:  # claims on the shared pool: no process of its own to start or stop
            self.standby = want.standby
        return target, acts

    def _fill_standby(self, want: int, now: float) -> None:
        """The model's own standby processes (no catalogue): started or stopped to
        ``want`` (a standby start is a cold start less the weights' load)."""
        p = self.promo
        pending = sum(1 for e in self.creating if e[1] is Tier.standby)
        have = self.standby + pending
        for _ in range(want - have):
            ready = now + max(p.cold_s - p.standby_s, 0.0)
            heapq.heappush(self.creating, (ready, Tier.standby, Source.cold))
        for _ in range(have - want):
            if pending:
                last = max(e for e in self.creating if e[1] is Tier.standby)
                self.creating.remove(last)
                heapq.heapify(self.creating)
                pending -= 1
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
    for _ in loop.steps():
        pass
    return loop.result(policy_name)


def simulate_catalogue(
    traces: Sequence[Trace],
    autoscalers: Sequence[Autoscaler[Any, Any]],
    config: SimConfig,
    *,
    standby: StandbyPoolConfig | None = None,
    policy_name: str = "",
) -> tuple[list[SimResult], SharedStandby | None]:
    """Replay many models together, each with its own autoscaler and replicas, in time
    order; with ``standby``, the models' standby processes are one shared pool (a model's
    standby floor is a claim on it: see :class:`_Pool`).

    Models advance one tick at a time, the one furthest behind first, so the pool sees the
    asks in time order (to within a tick: the order of two asks within one tick is the
    models' order, not their exact times)."""
    shared = SharedStandby(standby) if standby is not None else None
    loops = [
        _Loop(tr, unit_costs(config.cost_model, tr), sc, config, shared=shared)
        for tr, sc in zip(traces, autoscalers, strict=True)
    ]
    runs = [loop.steps() for loop in loops]
    heap: list[tuple[float, int]] = []
    for i, run in enumerate(runs):
        t = next(run, None)
        if t is not None:
            heap.append((t, i))
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        t = next(runs[i], None)
        if t is not None:
            heapq.heappush(heap, (t, i))
    return [loop.result(policy_name) for loop in loops], shared


class _Loop:
    def __init__(
        self,
        trace: Trace,
        work: FloatArray,
        autoscaler: Autoscaler[Any, Any],
        cfg: SimConfig,
        *,
        shared: SharedStandby | None = None,
    ) -> None:
        self.cfg = cfg
        self.trace = trace
        self.shared = shared
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
        self.plans: list[PlanStep] = []

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
            ready=TierCounts(p.hot, p.warm, p.ready_standby(now)),
            promoting=len(p.promoting),
            promotion=self.cfg.promotion,
            # Little's law with a request's batch-1 latency = its cost in seconds.
            inflight_requests=served_rate,
            queued_requests=self.backlog / self.mean_cost,
        )
        decision = self.scaler.step(obs, now)
        self.decisions += 1
        inventory = p.inventory()
        target, actions = p.apply(decision.desired, now, self.cfg)
        if self.cfg.record_plans:
            self.plans.append(PlanStep(now, obs, decision.desired, inventory, target, actions))
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

    def steps(self) -> Iterator[float]:
        """Run the replay; before each tick, yield its start (a catalogue interleaves the
        models' ticks in time order: a tick only asks the shared pool at or after it)."""
        tick = self.cfg.tick_s
        self._decide(0.0)
        self.pool.complete(math.inf)  # deployed before the trace starts
        self.pool.promoting.clear()
        if self.shared is not None:  # from now on, standby processes are the shared pool's
            self.pool.shared = self.shared
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
            yield t
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
            trace=self.trace.name,
            duration_s=self.trace.duration_s,
            standby_takes_s=np.asarray(self.pool.standby_takes, dtype=np.float64),
            plans=self.plans,
        )


def catalogue(
    results: Sequence[SimResult],
    name: str,
    tier_cost: TierCost,
    shared: SharedStandby | None = None,
) -> SimResult:
    """Many models' results as one catalogue; with ``shared``, the standby tier is the
    shared pool's process-seconds (after the warm-up, to the longest trace's end)."""
    first = results[0]
    end = max((r.duration_s for r in results), default=0.0)
    replica_s = {k: sum(r.replica_s[k] for r in results) for k in first.replica_s}
    if shared is not None:
        replica_s["standby"] += shared.held_s(first.warmup_s, end)
    weighted = (
        tier_cost.hot * replica_s["hot"]
        + tier_cost.warm * replica_s["warm"]
        + tier_cost.standby * replica_s["standby"]
    )
    cat = np.concatenate
    return SimResult(
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
        duration_s=end,
        standby_takes_s=np.sort(cat([r.standby_takes_s for r in results])),
    )
