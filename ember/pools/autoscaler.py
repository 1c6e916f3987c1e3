"""Predictive autoscaler: scale to warm, ahead of demand.

The policy is a pure function, shaped like Ray Serve's
``replica_queue_length_autoscaling_policy``: it takes what was observed, the state it
returned last time and its config, and returns the replicas it wants per tier with its
new state and the reasons::

    decision = decide(observation, state, config, now)
    decision.desired      # TierCounts(hot=..., warm=..., standby=...)
    decision.state        # feed it back next tick
    decision.reasons      # why, in words

:class:`Autoscaler` holds the state, stamps the clock and logs every decision with its
inputs. The pools controller and the simulator both call it; nothing else changes state.

How ``decide`` works, all in model units per second:

1. **Forecast** demand at each tier's horizon: level + trend (time-aware Holt smoothing)
   or the level moved by the daily / weekly profile's change from now to then (additive:
   robust for sparse models), whichever is larger; each tier covers the
   ``forecast_quantile`` of it (the mean plus the normal quantile of the short-window
   demand's spread around the level), not the mean. Plus a **burst guard** (a decaying
   envelope of the last ~10 s of demand, at full utilization).
2. **Every tier staged for its own horizon** (a :class:`Stage` each): hot covers the
   forecast one promotion from the next tier in use below it (``t + warm_s``), hot + warm
   one from the next below that (``t + standby_s``), all three one cold start ahead
   (``t + cold_s``), each horizon with a ``stage_margin`` and a tick. Hot looks at least
   as far as the tier it would promote from now (a cold start with no warm or standby
   replica ready). **Cost-aware**: a tier that costs as much as the faster one above it
   (``warm_cost``, ``standby_cost``; with dedicated GPUs both are 1) is not used as a
   buffer -- the faster tier covers its horizon, and no spares are kept in it.
3. Hot replicas = the hot stage's forecast over ``capacity x target_utilization``. A
   **queue** adds what drains it within ``drain_s`` (or ``drain_per_promotion`` of the
   time the capacity takes to come, if longer: a start that arrives after the queue has
   gone is a promotion's device time for nothing) while arrivals go on at the forecast
   (hot headroom that already does so adds nothing); async jobs drain within
   ``async_drain_s``. **Panic** when the queue grows while demand exceeds hot capacity:
   size for the last tick's demand and the queue at full utilization and never scale
   down meanwhile.
4. Scale-down only after ``stabilization_s`` (the most hot replicas the forecast
   recommended in that window stays; queue and panic capacity after ``burst_hold_s``; the
   burst guard's as its envelope decays, over ``burst_decay_s``), ``idle_hold_s``
   after the last request for a model without a hot floor, and **one tier at a time**: a
   hot replica becomes warm, stays warm for ``warm_keep_s``, then standby until
   ``standby_keep_s`` (by default no longer: the standby tier is the shared pool), then
   goes. Scale-up is at once. Each of these holds lasts at least ``release_hold``
   promotion times of where a released hot replica comes back from (ski rental: where
   that is a 120 s cold start, with no cheaper tier to keep it in, a replica stays hot
   for 10 min after it was last needed; where it is a 2 s warm promotion, 10 s) -- for
   bursty demand. Demand the forecast tracks (its short-window spread within
   ``smooth_cv`` of the level) holds ``release_hold_smooth`` (one) promotion time: the
   most its noise asked for in the last 10 min is device time for nothing.
5. **Warm buffer, burst-aware** (where warm is worth its cost): hot + warm cover the warm
   stage; while the model is in use they also carry the largest single-tick demand of the
   recent past (``surge``, forgotten over ``surge_decay_s``) at full utilization, so a
   burst is met by warm promotions, not by cold starts; plus ``warm_spare_fraction``
   spares. Standby covers the standby stage where it is worth its cost.
6. ``min_hot`` floor, ``max_replicas`` cap (hot + warm + standby), **scheduled floors**
   (``schedules``: cron, time zone, duration, ``min_hot``, ``min_warm``), each applied
   ahead by the promotion time of the tier that fills it. A model that opts out of the
   hot floor (``scale_to_zero``) keeps ``min_warm`` warm replicas while it was used within
   ``warm_keep_s`` or it was used at this time of day on most recent days
   (``predict_active_fraction`` of the daily activity profile, ``predict_horizon_s``
   ahead) -- otherwise a ``min_standby`` standby floor: a predicted-idle model waits a
   standby load, not a cold start, and costs a share of the (generic, shared) standby
   pool instead of a warm replica.

The state (:class:`EmberState`) is plain data: :func:`state_to_dict` /
:func:`state_from_dict` persist it (the pools controller keeps it in Redis, so a learned
profile survives a restart and a change of leader).

The policy only ever sees the past: observations up to ``now`` and what it learned
from them.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from statistics import NormalDist
from typing import Any, Generic, TypeVar
from zoneinfo import ZoneInfo

from ember.domain.spec import Source, Tier
from ember.logs import get_logger, model_context
from ember.registry.schemas import PoolPolicy

_EPS = 1e-9
_DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class TierCounts:
    """Replicas per tier (cold replicas are not counted: nothing of them is alive)."""

    hot: int = 0
    warm: int = 0
    standby: int = 0

    @property
    def total(self) -> int:
        return self.hot + self.warm + self.standby


@dataclass(frozen=True, slots=True)
class PromotionTimes:
    """Seconds from a tier to serving (p95; the pools controller learns them online).

    The defaults are what ``bench/coldstart.py`` measured on this project's machine for a
    1 GiB model (see :data:`PROMOTION_SOURCE`); ``ember simulate``, ``bench/autoscale.py``
    and the controller (until it has measured its own) all start from them.
    """

    warm_s: float = 0.6
    """Weights in host RAM: one host-to-device copy of the 1 GiB (0.55 s at 1.9 GB/s, the
    slowest memcpy measured here; on CPU warm -> hot is a flag, 0.19 s to first response)."""
    standby_s: float = 2.5
    """Process up, no weights: stream them from the NVMe cache (2.46 s measured)."""
    cold_s: float = 8.0
    """Nothing alive: spawn, imports, load from the NVMe cache (7.9 s measured; 17.0 s when
    the cache is empty and the object store fills it)."""

    def of(self, source: Source) -> float:
        """Seconds to serving from ``source``."""
        return {Source.warm: self.warm_s, Source.standby: self.standby_s,
                Source.cold: self.cold_s}[source]  # fmt: skip

    def describe(self) -> str:
        return f"warm {self.warm_s:g} s, standby {self.standby_s:g} s, cold {self.cold_s:g} s"


PROMOTION_SOURCE = (
    "bench/coldstart.py, 1 GiB model, first response: warm 0.19 s + a 1 GiB host-to-device "
    "copy, standby 2.46 s (NVMe cache, page cache dropped), cold 7.9 s (spawn + imports + "
    "NVMe load)"
)
"""Where :class:`PromotionTimes`' defaults come from (printed by ``ember simulate`` and
``bench/autoscale.py``)."""


@dataclass(frozen=True, slots=True)
class Observation:
    """What the controller (or the simulator) saw over the last ``interval_s`` seconds.

    Demand and capacity are in model units (see ``ember.costmodel``); request counts are
    there only for policies that think in requests (Ray Serve's ongoing requests).
    """

    interval_s: float
    arrived_units_per_s: float
    """Demand that arrived, admitted or not."""
    admitted_units_per_s: float
    inflight_units: float
    queued_units: float
    capacity_units_per_s: float
    """One hot replica's throughput (calibration)."""
    ready: TierCounts
    """Replicas ready in each tier now (``hot`` = serving)."""
    promoting: int = 0
    """Replicas on their way to hot."""
    promotion: PromotionTimes = field(default_factory=PromotionTimes)
    inflight_requests: float = 0.0
    queued_requests: float = 0.0
    async_queued_units: float = 0.0
    """Units of unfinished async jobs: no wait SLO, so drained within ``async_drain_s``
    (never a panic); online queues go in ``queued_units``."""


S = TypeVar("S")
C = TypeVar("C")


@dataclass(frozen=True, slots=True)
class Decision(Generic[S]):
    desired: TierCounts
    state: S
    reasons: tuple[str, ...]
    forecast_units_per_s: float = 0.0
    lead_s: float = 0.0
    next_eval_s: float = math.inf
    """Earliest time the decision can change if nothing arrives (a hint for simulators
    that skip idle stretches; a live controller just ticks)."""
    stages: tuple[Any, ...] = ()
    """Ember's policy: one :class:`Stage` per tier, what it was sized for."""


Policy = Callable[[Observation, S, C, float], Decision[S]]


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class ScheduledFloor:
    """A deployment's capacity schedule (``PoolPolicy.schedules``): from each ``cron`` fire
    time (in ``timezone``) for ``duration_s``, at least ``min_hot`` hot and ``min_warm``
    warm replicas."""

    cron: str
    timezone: str = "UTC"
    duration_s: float = 3600.0
    min_hot: int = 0
    min_warm: int = 0

    def active(self, at: float) -> bool:
        """Whether ``at`` (epoch seconds) is within ``duration_s`` of a fire time."""
        from croniter import croniter

        # get_prev is strictly before its start: half a second on, a fire at ``at`` counts.
        start = datetime.fromtimestamp(at + 0.5, ZoneInfo(self.timezone))
        fired = croniter(self.cron, start).get_prev(datetime)
        return bool(at - fired.timestamp() < self.duration_s)


@dataclass(frozen=True, slots=True)
class EmberConfig:
    """The deployment's :class:`PoolPolicy` fields plus the autoscaler's own knobs."""

    min_hot: int = 1
    scale_to_zero: bool = False
    max_replicas: int = 4
    target_utilization: float = 0.7
    level_tau_s: float = 180.0
    """Smoothing of the demand level."""
    trend_tau_s: float = 120.0
    """Smoothing of the demand trend."""
    burst_tau_s: float = 10.0
    """Short-window demand the burst guard follows."""
    burst_decay_s: float = 30.0
    """How fast the burst guard forgets a burst."""
    burst_guard: float = 1.0
    """Fraction of the recent short-window peak kept at full capacity."""
    profile_bin_s: float = 600.0
    profile_periods_s: tuple[float, ...] = (86_400.0, 604_800.0)
    profile_weight: float = 0.3
    """Weight of the newest period in a profile bin (EWMA across days / weeks)."""
    drain_s: float = 1.0
    """Extra hot capacity drains the queue within this (the SLO is a wait of seconds)."""
    drain_per_promotion: float = 0.1
    """... and within no less than this fraction of the time the capacity takes to come
    (a start that arrives after the queue has gone costs a promotion's device time)."""
    async_drain_s: float = 60.0
    """... and the async job backlog within this."""
    panic_hold_s: float = 1.0
    panic_wait_s: float = 1.0
    """Panic when the queue holds more than this many seconds of hot capacity and grows."""
    stabilization_s: float = 60.0
    """Hot -> warm only after this long with fewer hot replicas recommended."""
    burst_hold_s: float = 2.0
    """Capacity added for a queue or a panic stays hot this long (it comes back from warm
    in one promotion if the queue does)."""
    idle_hold_s: float = 10.0
    """No arrivals for this long: drop to the ``min_hot`` floor (hot -> warm)."""
    release_hold: float = 5.0
    """Every hold above (``stabilization_s``, ``burst_hold_s``, ``idle_hold_s``) lasts at
    least this many times the promotion time a released hot replica takes to come back
    (from warm where warm is used, else standby, else a cold start). Ski rental: holding an
    idle replica for one promotion time costs what its return does, and where that time is
    over the SLO a release the demand undoes is a burst of misses. With dedicated GPUs
    (cold 120 s, no cheaper tier) capacity stays 10 min; where warm promotes in 2 s, 10 s.
    (``bench/autoscale.py``, Azure ``code``: 2 -> 5 took gpu-dedicated from 18 % to 6 %
    over the SLO, gpu-shared from 5.3 % to 3.5 %; dense m-large paid ~7 % more hot.)
    That is the hold for bursty demand (``Forecaster.burstiness`` at least ``bursty_cv``);
    see ``release_hold_smooth``."""
    release_hold_smooth: float = 1.0
    """The release hold for demand the forecast tracks (burstiness at most ``smooth_cv``),
    in between in proportion. There a release is rarely undone within the cold-start
    horizon the forecast already covers, and the longer hold only keeps the most the
    noise asked for (``bench/autoscale.py --quick``, dense m-large at the setting within
    99.9 % of the SLO: gpu-dedicated 0.652x -> 0.594x static peak, gpu-shared 0.516x ->
    0.504x, cpu 0.436x -> 0.428x; bursty Azure ``code``, burstiness ~1.2, unchanged)."""
    smooth_cv: float = 0.2
    """Burstiness up to which demand counts as smooth (Poisson at 20 req/s: ~0.08)."""
    bursty_cv: float = 0.6
    """Burstiness from which demand counts as bursty (Azure ``code``: median 1.2)."""
    warm_keep_s: float = 600.0
    """Replicas recommended in this window stay warm; a model that opted out of the hot
    floor keeps its warm floor this long after its last request (or while its profile
    expects requests), then a standby one."""
    standby_keep_s: float = 600.0
    """Replicas recommended in this window (and not warm) stay standby. Standby processes
    hold no weights and are one pool shared by every deployment, so by default a model
    keeps no standby of its own beyond its floor (a large one waking up would otherwise
    size the shared pool): replicas go warm -> cold after ``warm_keep_s``."""
    warm_spare_fraction: float = 0.25
    """Warm replicas kept per hot one, so the next scale-up is a warm promotion."""
    warm_spares: int = 2
    """... and at least this many while any replica is hot: before it has seen a burst,
    a model can still grow this much within one promotion."""
    surge_decay_s: float = 1_800.0
    """Memory of the largest single-tick demand (the surge the warm tier must absorb)."""
    surge_s: float = 1.0
    """Hot + warm serve the remembered largest tick's units within this many seconds."""
    min_warm: int | None = None
    """Warm floor; default 1 when ``min_hot`` is 0 (scale to warm, not to zero)."""
    min_standby: int | None = None
    """Standby floor when the warm floor lapses; default 1 when ``min_hot`` is 0."""
    predict_horizon_s: float = 1_800.0
    """A model that was used at this time of day on most recent days (within this
    horizon ahead) keeps its warm floor through an idle spell."""
    predict_active_fraction: float = 0.5
    """... "most": the EWMA (``profile_weight`` per day) of "had requests in this bin"."""
    tick_s: float = 1.0
    warm_cost: float = 0.1
    """Cost of a warm replica-second, hot = 1 (weights in host RAM, the device released to
    other models). A tier that costs as much as the faster one above it is not used as a
    buffer: what it would hold is kept in the faster tier, and its spares are not kept."""
    standby_cost: float = 0.03
    """Cost of a standby replica-second, hot = 1 (a process with its runtime, no weights)."""
    forecast_quantile: float = 0.8
    """Each tier covers this quantile of the forecast (normal, with the spread of the
    short-window demand around the level), not its mean."""
    stage_margin: float = 0.1
    """Each tier's horizon is its promotion time times (1 + this) plus one tick: capacity is
    ready a little before the forecast says it is needed, not exactly then."""
    schedules: tuple[ScheduledFloor, ...] = ()
    """Scheduled floors, each applied ahead by the promotion time of the tier it fills."""

    @classmethod
    def from_policy(cls, policy: PoolPolicy, **knobs: Any) -> EmberConfig:
        schedules = tuple(
            ScheduledFloor(s.cron, s.timezone, s.duration_s, s.min_hot, s.min_warm)
            for s in policy.schedules
        )
        return cls(
            min_hot=policy.min_hot,
            scale_to_zero=policy.scale_to_zero,
            max_replicas=policy.max_replicas,
            target_utilization=policy.target_utilization,
            **({"schedules": schedules} | knobs),
        )

    @property
    def uses_warm(self) -> bool:
        """Warm is a buffer worth keeping: cheaper than hot."""
        return self.warm_cost < 1.0 - _EPS

    @property
    def uses_standby(self) -> bool:
        """Standby is a buffer worth keeping: cheaper than the tier above it in use."""
        return self.standby_cost < (self.warm_cost if self.uses_warm else 1.0) - _EPS

    @property
    def below_hot(self) -> Source:
        """Where a released hot replica goes, and comes back from: the next tier below hot
        worth its cost (a cold start where neither is)."""
        if self.uses_warm:
            return Source.warm
        return Source.standby if self.uses_standby else Source.cold

    @property
    def warm_floor(self) -> int:
        if self.min_warm is not None:
            return self.min_warm
        return 1 if self.min_hot == 0 else 0

    @property
    def standby_floor(self) -> int:
        if self.min_standby is not None:
            return self.min_standby
        return 1 if self.min_hot == 0 else 0


# ------------------------------------------------------------------------- forecaster


@dataclass(frozen=True, slots=True)
class Forecaster:
    """Holt level + trend, burst and surge envelopes and periodic profiles; immutable."""

    level: float = 0.0
    trend: float = 0.0
    short: float = 0.0
    envelope: float = 0.0
    surge: float = 0.0
    """Decaying maximum of single-tick demand."""
    bin_start_s: float | None = None
    bin_units: float = 0.0
    profiles: tuple[tuple[float, ...], ...] = ()
    """Per period, units/s per bin (NaN: never seen)."""
    activity: tuple[float, ...] = ()
    """Per daily bin, EWMA of "had any demand" (NaN: never seen)."""
    spread: float = 0.0
    """EWMA (over ``level_tau_s``) of the squared gap between the short-window demand and
    the level: the variance the forecast quantile adds."""

    @property
    def burstiness(self) -> float:
        """The short-window demand's spread around the level, relative to the level (a
        coefficient of variation; 1 for no demand)."""
        return math.sqrt(self.spread) / self.level if self.level > _EPS else 1.0

    def update(self, demand: float, dt: float, now: float, cfg: EmberConfig) -> Forecaster:
        level = self.level + (1.0 - math.exp(-dt / cfg.level_tau_s)) * (demand - self.level)
        slope = (level - self.level) / dt if dt > 0 else 0.0
        trend = self.trend + (1.0 - math.exp(-dt / cfg.trend_tau_s)) * (slope - self.trend)
        short = self.short + (1.0 - math.exp(-dt / cfg.burst_tau_s)) * (demand - self.short)
        envelope = max(short, self.envelope * math.exp(-dt / cfg.burst_decay_s))
        # A tick's demand, never a rate over less than a tick (an activator's call at the
        # first arrival covers an instant).
        tick_demand = demand * dt / max(dt, cfg.tick_s)
        surge = max(tick_demand, self.surge * math.exp(-dt / cfg.surge_decay_s))
        gap2 = (short - level) ** 2
        spread = self.spread + (1.0 - math.exp(-dt / cfg.level_tau_s)) * (gap2 - self.spread)
        bin_start, bin_units, profiles, activity = self._roll_profile(demand * dt, now, cfg)
        return Forecaster(
            level, trend, short, envelope, surge, bin_start, bin_units, profiles, activity, spread
        )

    def _roll_profile(
        self, units: float, now: float, cfg: EmberConfig
    ) -> tuple[float, float, tuple[tuple[float, ...], ...], tuple[float, ...]]:
        if self.bin_start_s is None:
            start = math.floor(now / cfg.profile_bin_s) * cfg.profile_bin_s
            profiles = tuple(
                (math.nan,) * round(p / cfg.profile_bin_s) for p in cfg.profile_periods_s
            )
            activity = (math.nan,) * round(_day_s(cfg) / cfg.profile_bin_s)
            return start, units, profiles, activity
        if now < self.bin_start_s + cfg.profile_bin_s:
            return self.bin_start_s, self.bin_units + units, self.profiles, self.activity
        # Close the bin, and the bins skipped since (an idle stretch): they saw no demand.
        profiles, activity = self.profiles, self.activity
        start, carried = self.bin_start_s, self.bin_units
        newest = math.floor(now / cfg.profile_bin_s) * cfg.profile_bin_s
        longest = max([len(activity), *(len(p) for p in profiles)])
        skipped = 0
        while start < newest and skipped < longest:
            rate = carried / cfg.profile_bin_s
            w = cfg.profile_weight
            profiles = tuple(
                _set_bin(prof, _bin(start, len(prof), cfg), rate, w) for prof in profiles
            )
            active = 1.0 if carried > 0 else 0.0
            activity = _set_bin(activity, _bin(start, len(activity), cfg), active, w)
            carried = 0.0
            start += cfg.profile_bin_s
            skipped += 1
        return newest, units, profiles, activity

    def profile_step(self, now: float, lead: float, cfg: EmberConfig) -> float:
        """Profile at ``now + lead`` less profile now, units/s (the longest period with data
        in both bins; 0 if none). Additive, not a ratio: a sparse model's ratio of two
        small, noisy bins would be a spike."""
        for prof in reversed(self.profiles):
            here = prof[_bin(now, len(prof), cfg)]
            there = prof[_bin(now + lead, len(prof), cfg)]
            if not math.isnan(here) and not math.isnan(there):
                return there - here
        return 0.0

    def forecast(self, now: float, lead: float, cfg: EmberConfig) -> float:
        """Mean demand at ``now + lead``: Holt's level + trend, or the level moved by the
        daily / weekly profile's change from now to then, whichever is larger."""
        holt = self.level + self.trend * lead
        seasonal = self.level + self.profile_step(now, lead, cfg)
        return max(holt, seasonal, 0.0)

    def quantile(self, now: float, lead: float, cfg: EmberConfig) -> float:
        """The ``forecast_quantile`` of demand at ``now + lead``: the mean plus the normal
        quantile of the spread."""
        mean = self.forecast(now, lead, cfg)
        if cfg.forecast_quantile <= 0.5 or self.spread <= 0:
            return mean
        return mean + _z(cfg.forecast_quantile) * math.sqrt(self.spread)

    def active_ahead(self, now: float, horizon: float, cfg: EmberConfig) -> float:
        """How regularly the model had requests at this time of day (the most of the
        daily bins over ``[now, now + horizon]``; 0 for bins never seen)."""
        if not self.activity:
            return 0.0
        n = len(self.activity)
        first, last = int(now // cfg.profile_bin_s), int((now + horizon) // cfg.profile_bin_s)
        best = 0.0
        for k in range(first, last + 1):
            v = self.activity[k % n]
            if not math.isnan(v) and v > best:
                best = v
        return best


def _day_s(cfg: EmberConfig) -> float:
    """The day the activity profile covers: the first profile period (a compressed day in
    tests and demos), else 24 h."""
    return cfg.profile_periods_s[0] if cfg.profile_periods_s else _DAY_S


@functools.lru_cache(maxsize=16)
def _z(quantile: float) -> float:
    return NormalDist().inv_cdf(min(quantile, 0.9999))


def _bin(t: float, nbins: int, cfg: EmberConfig) -> int:
    return int(t // cfg.profile_bin_s) % nbins


def _set_bin(prof: tuple[float, ...], k: int, value: float, w: float) -> tuple[float, ...]:
    old = prof[k]
    new = value if math.isnan(old) else old + w * (value - old)
    return (*prof[:k], new, *prof[k + 1 :])


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS) if x > _EPS else 0


# ------------------------------------------------------------------------- the policy


@dataclass(frozen=True, slots=True)
class EmberState:
    forecaster: Forecaster = field(default_factory=Forecaster)
    last_t: float | None = None
    last_arrival_t: float = -math.inf
    last_queued: float = 0.0
    panic_until: float = -math.inf
    recent: tuple[tuple[float, int], ...] = ()
    """(time, hot for sustained demand), a max-deque over ``standby_keep_s``."""
    bursts: tuple[tuple[float, int], ...] = ()
    """(time, hot including queue and panic), a max-deque over ``burst_hold_s``."""


def _push_max(
    window: tuple[tuple[float, int], ...], now: float, value: int, span: float
) -> tuple[tuple[float, int], ...]:
    kept = [e for e in window if e[0] > now - span]
    while kept and kept[-1][1] <= value:
        kept.pop()
    kept.append((now, value))
    return tuple(kept)


def _max_since(window: tuple[tuple[float, int], ...], since: float) -> int:
    # Values fall along the deque, so the first entry inside the span is its maximum.
    for t, v in window:
        if t > since:
            return v
    return 0


@dataclass(frozen=True, slots=True)
class Stage:
    """What one tier (with the faster ones) is sized for: the forecast quantile at
    ``horizon_s`` ahead (the promotion time of the tier it is filled from, plus margin)."""

    tier: Tier
    """The slowest tier of the stage: ``hot`` covers hot alone, ``warm`` hot + warm,
    ``standby`` hot + warm + standby."""
    source: Source
    """Where it is filled from."""
    promotion_s: float
    horizon_s: float
    forecast_units_per_s: float
    replicas: int


_STAGE_NAMES = {Tier.hot: "hot", Tier.warm: "hot+warm", Tier.standby: "hot+warm+standby"}


def _source_tier(obs: Observation) -> Source:
    if obs.ready.warm > 0:
        return Source.warm
    if obs.ready.standby > 0:
        return Source.standby
    return Source.cold


def _stages(
    obs: Observation, fc: Forecaster, cfg: EmberConfig, now: float
) -> tuple[Stage, Stage, Stage]:
    """Every tier staged for its own horizon: hot covers the forecast one promotion from
    the next tier in use below it (warm), hot + warm one from the next below that
    (standby), all three one cold start ahead. A tier not worth its cost (see
    ``EmberConfig.uses_warm``) is skipped: the tier above covers its horizon. Hot looks at
    least as far ahead as the tier it would actually promote from now."""
    p = obs.promotion
    below_warm = Source.standby if cfg.uses_standby else Source.cold
    below_hot = cfg.below_hot
    source = _source_tier(obs)
    hot_from = source if p.of(source) > p.of(below_hot) else below_hot
    per = max(obs.capacity_units_per_s, _EPS) * cfg.target_utilization

    def stage(tier: Tier, source: Source, floor_s: float = 0.0) -> Stage:
        promo = max(p.of(source), floor_s)
        horizon = promo * (1.0 + cfg.stage_margin) + cfg.tick_s
        f = fc.quantile(now, horizon, cfg)
        return Stage(tier, source, promo, horizon, f, _ceil(f / per))

    hot = stage(Tier.hot, hot_from)
    warm = stage(Tier.warm, below_warm, hot.promotion_s)
    total = stage(Tier.standby, Source.cold, warm.promotion_s)
    return hot, warm, total


def decide(
    obs: Observation, state: EmberState, cfg: EmberConfig, now: float
) -> Decision[EmberState]:
    """Ember's predictive policy (pure; see the module docstring)."""
    dt = max(obs.interval_s, _EPS)
    demand = obs.arrived_units_per_s
    fc = state.forecaster.update(demand, dt, now, cfg)
    # A new deployment counts as used now: it starts warm, not in the standby floor.
    last_arrival = now if demand > 0 or state.last_t is None else state.last_arrival_t
    stages = _stages(obs, fc, cfg, now)
    reasons: list[str] = [
        f"forecast q{cfg.forecast_quantile:g} {s.forecast_units_per_s:.3g} u/s at "
        f"+{s.horizon_s:.3g}s ({_STAGE_NAMES[s.tier]}, from {s.source} in "
        f"{s.promotion_s:g}s) -> {s.replicas}"
        for s in stages
    ]
    hot_stage = stages[0]
    holds = _Holds.of(obs, cfg, fc)
    base, want, panic_until, idle = _hot_wanted(
        obs, state, fc, cfg, now, hot_stage, last_arrival, holds, reasons
    )
    if idle:
        stages = tuple(replace(s, replicas=0) for s in stages)  # type: ignore[assignment]
    base, want = min(base, cfg.max_replicas), min(want, cfg.max_replicas)
    # Sustained demand (base) steps down only after the stabilization window; capacity
    # added for a queue or a panic goes back to warm after the short burst hold (it comes
    # back in one warm promotion if needed).
    recent = _push_max(state.recent, now, base, cfg.standby_keep_s)
    bursts = _push_max(state.bursts, now, want, holds.burst_s)
    held = _max_since(recent, now - holds.stabilization_s)
    hot = want if idle else max(want, held, _max_since(bursts, now - holds.burst_s))
    if hot > want:
        reasons.append(f"stabilizing: {hot} hot (most in the last {holds.stabilization_s:g}s)")
    if idle:
        reasons.append(f"idle {now - last_arrival:.0f}s: hot -> warm down to the floor")
    if hot < cfg.min_hot:
        hot = cfg.min_hot
        reasons.append(f"floor min_hot={cfg.min_hot}")
    floors = _floors(fc, cfg, now, last_arrival)
    if cfg.schedules:
        sched_hot, sched_warm = _scheduled(obs, cfg, now, stages)
        if sched_hot > hot:
            hot = sched_hot
            reasons.append(f"scheduled: {sched_hot} hot")
        if sched_warm > floors[0]:
            floors = (sched_warm, floors[1])
            reasons.append(f"scheduled: {sched_warm} warm")
    hot = min(hot, cfg.max_replicas)
    cap = max(obs.capacity_units_per_s, _EPS)
    warm = _warm_wanted(fc, cfg, now, last_arrival, hot, recent, stages[1], floors[0], cap, reasons)
    standby = _standby_wanted(cfg, now, hot, warm, recent, stages[2], floors[1])
    if floors[0] < cfg.warm_floor and hot + warm == 0:
        reasons.append(f"idle {now - last_arrival:.0f}s, none expected: standby floor")
    new_state = EmberState(fc, now, last_arrival, obs.queued_units, panic_until, recent, bursts)
    return Decision(
        desired=TierCounts(hot, warm, standby),
        state=new_state,
        reasons=tuple(reasons),
        forecast_units_per_s=hot_stage.forecast_units_per_s,
        lead_s=hot_stage.promotion_s,
        next_eval_s=_next_eval(obs, new_state, cfg, now, idle),
        stages=stages,
    )


@dataclass(frozen=True, slots=True)
class _Holds:
    """The holds in force: each window, and the queue's drain time, no shorter than what
    bringing capacity back costs (``EmberConfig.release_hold``)."""

    stabilization_s: float
    burst_s: float
    idle_s: float
    drain_s: float

    @classmethod
    def of(cls, obs: Observation, cfg: EmberConfig, fc: Forecaster) -> _Holds:
        p = obs.promotion
        floor = release_hold(fc, cfg) * p.of(cfg.below_hot)
        # A queue is drained by capacity from where hot is filled now: a drain asked for
        # quicker than that starts replicas that arrive after the queue has gone.
        return cls(
            max(cfg.stabilization_s, floor),
            max(cfg.burst_hold_s, floor),
            max(cfg.idle_hold_s, floor),
            max(cfg.drain_s, cfg.drain_per_promotion * p.of(_source_tier(obs))),
        )


def release_hold(fc: Forecaster, cfg: EmberConfig) -> float:
    """``release_hold`` for bursty demand, ``release_hold_smooth`` for demand the forecast
    tracks, by the demand's burstiness (``Forecaster.burstiness``) between ``smooth_cv``
    and ``bursty_cv``."""
    lo, hi = cfg.release_hold_smooth, cfg.release_hold
    if hi <= lo or cfg.bursty_cv <= cfg.smooth_cv:
        return hi
    x = (fc.burstiness - cfg.smooth_cv) / (cfg.bursty_cv - cfg.smooth_cv)
    return lo + (hi - lo) * min(1.0, max(0.0, x))


def _hot_wanted(
    obs: Observation,
    state: EmberState,
    fc: Forecaster,
    cfg: EmberConfig,
    now: float,
    stage: Stage,
    last_arrival: float,
    holds: _Holds,
    reasons: list[str],
) -> tuple[int, int, float, bool]:
    """(hot for sustained demand, hot wanted now, panic until, idle): the hot stage, the
    burst guard, the queue to drain and the panic."""
    demand = obs.arrived_units_per_s
    forecast = stage.forecast_units_per_s
    guard = fc.envelope * cfg.burst_guard
    cap = max(obs.capacity_units_per_s, _EPS)
    drain = obs.queued_units / holds.drain_s + obs.async_queued_units / cfg.async_drain_s
    base = want = stage.replicas
    if _ceil(guard / cap) > want:
        want = _ceil(guard / cap)
        reasons.append(f"burst guard {guard:.3g} u/s -> {want}")
    if drain > _EPS:
        # Arrivals keep coming at the forecast rate; what is left over drains the queue.
        # Hot headroom that already does so adds nothing (a queue that outgrows it is a
        # panic, below).
        want_q = _ceil((forecast + drain) / cap)
        if want_q > want:
            want = want_q
            reasons.append(
                f"queue {obs.queued_units:.3g} u (+{obs.async_queued_units:.3g} u async) "
                f"to drain -> {want}"
            )
    hot_now = obs.ready.hot + obs.promoting
    hot_cap = obs.ready.hot * cap
    panic_until = state.panic_until
    growing = obs.queued_units > state.last_queued + _EPS and demand > hot_cap
    if growing and obs.queued_units > cfg.panic_wait_s * hot_cap:
        panic_until = now + cfg.panic_hold_s
    if now < panic_until:
        want = max(want, _ceil((demand + drain) / cap), hot_now)
        reasons.append(f"panic until +{panic_until - now:.0f}s: no scale-down -> {want}")
    queued = obs.queued_units + obs.async_queued_units
    idle = now - last_arrival >= holds.idle_s and queued <= _EPS
    if idle:
        base = want = 0
    return base, want, panic_until, idle


def _warm_wanted(
    fc: Forecaster,
    cfg: EmberConfig,
    now: float,
    last_arrival: float,
    hot: int,
    recent: tuple[tuple[float, int], ...],
    stage: Stage,
    floor: int,
    cap: float,
    reasons: list[str],
) -> int:
    """Warm: its stage (hot + warm cover the forecast one standby load ahead), spares for
    the next scale-up, what sustained demand needed lately, and enough to absorb the
    largest recent single tick (promoted within one tick + warm_s) -- all only where warm
    is cheaper than hot; otherwise just the floor."""
    if not cfg.uses_warm:
        return max(0, min(floor, cfg.max_replicas - hot))
    active = now - last_arrival < cfg.warm_keep_s
    surge = _ceil(fc.surge * cfg.tick_s / (cap * cfg.surge_s)) if active else 0
    warm = max(
        floor,
        stage.replicas - hot,
        max(_ceil(cfg.warm_spare_fraction * hot), cfg.warm_spares if hot else 0),
        _max_since(recent, now - cfg.warm_keep_s) - hot,
        surge - hot,
    )
    warm = max(0, min(warm, cfg.max_replicas - hot))
    if surge > hot and warm >= surge - hot:
        reasons.append(f"surge {fc.surge:.3g} u/s in one tick -> {surge - hot} warm")
    return warm


def _standby_wanted(
    cfg: EmberConfig,
    now: float,
    hot: int,
    warm: int,
    recent: tuple[tuple[float, int], ...],
    stage: Stage,
    floor: int,
) -> int:
    """Standby: its stage (all tiers cover the forecast one cold start ahead) and what
    sustained demand needed within ``standby_keep_s`` -- only where standby is cheaper
    than the tier above it; and the standby floor."""
    standby = 0
    if cfg.uses_standby:
        standby = max(_max_since(recent, now - cfg.standby_keep_s), stage.replicas) - hot - warm
    standby = max(standby, floor - hot - warm, 0)
    return max(0, min(standby, cfg.max_replicas - hot - warm))


def _scheduled(
    obs: Observation, cfg: EmberConfig, now: float, stages: tuple[Stage, ...]
) -> tuple[int, int]:
    """(hot, warm) the schedules want now: a hot floor counts from one promotion before
    its event (from warm where enough warm replicas are ready, else from standby, else a
    cold start), a warm floor from one fill of the warm tier (its stage's horizon)."""
    p, margin = obs.promotion, 1.0 + cfg.stage_margin
    warm_ahead = stages[1].horizon_s

    def hot_ahead(want: int) -> float:
        short = want - obs.ready.hot
        if short <= obs.ready.warm:
            promo = p.warm_s
        elif short <= obs.ready.warm + obs.ready.standby:
            promo = p.standby_s
        else:
            promo = p.cold_s
        return max(promo, stages[0].promotion_s) * margin + cfg.tick_s

    hot = max((s.min_hot for s in cfg.schedules if s.min_hot and
               s.active(now + hot_ahead(s.min_hot))), default=0)  # fmt: skip
    warm = max((s.min_warm for s in cfg.schedules if s.min_warm and
                s.active(now + warm_ahead)), default=0)  # fmt: skip
    return hot, warm


def _floors(fc: Forecaster, cfg: EmberConfig, now: float, last_arrival: float) -> tuple[int, int]:
    """(warm, standby) floors: the warm floor holds while the model was used within
    ``warm_keep_s`` or its profile expects requests within ``predict_horizon_s``."""
    if cfg.warm_floor <= 0 or now - last_arrival < cfg.warm_keep_s:
        return cfg.warm_floor, cfg.standby_floor
    if fc.active_ahead(now, cfg.predict_horizon_s, cfg) >= cfg.predict_active_fraction:
        return cfg.warm_floor, cfg.standby_floor
    return 0, cfg.standby_floor


def _next_eval(obs: Observation, st: EmberState, cfg: EmberConfig, now: float, idle: bool) -> float:
    queued = obs.queued_units + obs.async_queued_units
    busy = obs.arrived_units_per_s > 0 or queued > _EPS or obs.promoting > 0
    if busy or not idle:
        return now + cfg.tick_s
    # Idle: only the tier windows and the floors can change the answer; wake when the
    # first of them expires (and at profile bin edges while the warm floor is predicted).
    expiries = [
        t + span
        for t, _ in st.recent
        for span in (cfg.stabilization_s, cfg.warm_keep_s, cfg.standby_keep_s)
        if t + span > now
    ]
    if cfg.warm_floor > 0:
        keep = st.last_arrival_t + cfg.warm_keep_s
        if keep > now:
            expiries.append(keep)
        else:
            expiries.append((math.floor(now / cfg.profile_bin_s) + 1) * cfg.profile_bin_s)
    return min(expiries, default=math.inf)


# ----------------------------------------------------------------- shared standby pool


@dataclass(frozen=True, slots=True)
class StandbyPoolConfig:
    """Size of the standby pool every deployment shares (generic processes, runtime
    imported, no weights): one more than the most wake-ups it has seen within one
    replacement time, never fewer than ``minimum``."""

    replenish_s: float = PromotionTimes().cold_s - PromotionTimes().standby_s
    """A process put to use is replaced by spawning a new one (interpreter and imports, no
    weights: a cold start less the weight load)."""
    margin: int = 1
    minimum: int = 1

    def size(self, state: StandbyPoolState) -> int:
        return max(self.minimum, state.peak + self.margin)


@dataclass(frozen=True, slots=True)
class StandbyPoolState:
    recent: tuple[float, ...] = ()
    """Standby processes asked for within the last ``replenish_s``."""
    peak: int = 0
    """The most asked for within any ``replenish_s`` so far."""


def size_standby_pool(
    state: StandbyPoolState, cfg: StandbyPoolConfig, now: float
) -> tuple[int, StandbyPoolState]:
    """Pure: count one standby process asked for at ``now`` (found or not) and return the
    pool size to hold from now on with the new state. Only the past counts: a pool that ran
    dry learns from it and is larger the next time."""
    recent = (*(t for t in state.recent if t > now - cfg.replenish_s), now)
    new = StandbyPoolState(recent, max(state.peak, len(recent)))
    return cfg.size(new), new


# ---------------------------------------------------------------------------- wrapper


class Autoscaler(Generic[S, C]):
    """Holds a policy's state and is what the pools controller and the simulator call.

    ``step(observation)`` stamps the clock, runs the pure policy, keeps the new state and
    logs the decision (inputs, desired tiers, reasons) in the model's context. With
    ``record=True`` it keeps every ``(now, observation, decision)`` for replay; with
    ``keep_last=N`` the last N of them.
    """

    def __init__(
        self,
        policy: Policy[S, C],
        config: C,
        state: S,
        *,
        clock: Callable[[], float],
        model: str = "",
        version: str = "",
        log_decisions: bool = True,
        record: bool = False,
        keep_last: int = 0,
    ) -> None:
        self.policy = policy
        self.config = config
        self.state = state
        self.clock = clock
        self.model = model
        self.version = version
        self.log_decisions = log_decisions
        self.history: list[tuple[float, Observation, Decision[S]]] | None = [] if record else None
        self.last: deque[tuple[float, Observation, Decision[S]]] = deque(maxlen=keep_last)
        """The last ``keep_last`` steps (what ``GET /v1/deployments/{name}/autoscaler``
        shows)."""
        self._log = get_logger("ember.pools.autoscaler")
        self._last: TierCounts | None = None

    def step(self, obs: Observation, now: float | None = None) -> Decision[S]:
        t = self.clock() if now is None else now
        decision = self.policy(obs, self.state, self.config, t)
        self.state = decision.state
        if self.history is not None:
            self.history.append((t, obs, decision))
        if self.last.maxlen:
            self.last.append((t, obs, decision))
        if self.log_decisions:
            self._emit(t, obs, decision)
        self._last = decision.desired
        return decision

    def _emit(self, t: float, obs: Observation, d: Decision[S]) -> None:
        changed = d.desired != self._last
        with model_context(self.model, self.version):
            (self._log.info if changed else self._log.debug)(
                "autoscaler decision",
                now=t,
                changed=changed,
                desired_hot=d.desired.hot,
                desired_warm=d.desired.warm,
                desired_standby=d.desired.standby,
                forecast_units_per_s=round(d.forecast_units_per_s, 4),
                lead_s=d.lead_s,
                arrived_units_per_s=round(obs.arrived_units_per_s, 4),
                queued_units=round(obs.queued_units, 4),
                inflight_units=round(obs.inflight_units, 4),
                ready_hot=obs.ready.hot,
                ready_warm=obs.ready.warm,
                ready_standby=obs.ready.standby,
                promoting=obs.promoting,
                reasons=list(d.reasons),
            )


def ember_autoscaler(
    config: EmberConfig, *, clock: Callable[[], float], **kwargs: Any
) -> Autoscaler[EmberState, EmberConfig]:
    """The predictive policy in its wrapper, from a fresh state."""
    return Autoscaler(decide, config, EmberState(), clock=clock, **kwargs)


# ------------------------------------------------------------------ persisted state

STATE_FORMAT = 1
"""Version of :func:`state_to_dict`'s layout (a stored state of another is ignored)."""


def state_to_dict(state: EmberState) -> dict[str, Any]:
    """The policy's state as plain JSON-able data (floats may be NaN or infinite: the
    stored JSON uses Python's ``NaN`` / ``Infinity``), to persist across restarts and
    leader changes. Times are wall-clock seconds (the controller's autoscaler clock)."""
    fc = state.forecaster
    return {
        "format": STATE_FORMAT,
        "forecaster": {
            "level": fc.level, "trend": fc.trend, "short": fc.short, "envelope": fc.envelope,
            "surge": fc.surge, "bin_start_s": fc.bin_start_s, "bin_units": fc.bin_units,
            "profiles": [list(p) for p in fc.profiles], "activity": list(fc.activity),
            "spread": fc.spread,
        },
        "last_t": state.last_t, "last_arrival_t": state.last_arrival_t,
        "last_queued": state.last_queued, "panic_until": state.panic_until,
        "recent": [list(e) for e in state.recent], "bursts": [list(e) for e in state.bursts],
    }  # fmt: skip


def state_from_dict(data: dict[str, Any], cfg: EmberConfig) -> EmberState | None:
    """:func:`state_to_dict`'s inverse; ``None`` when the data is not a state of this
    format or its profiles do not fit ``cfg`` (other periods or bins: start afresh)."""
    try:
        if data.get("format") != STATE_FORMAT:
            return None
        f = data["forecaster"]
        profiles = tuple(tuple(float(x) for x in p) for p in f["profiles"])
        activity = tuple(float(x) for x in f["activity"])
        if profiles:
            lengths = tuple(len(p) for p in profiles)
            if lengths != tuple(round(p / cfg.profile_bin_s) for p in cfg.profile_periods_s):
                return None
            if len(activity) != round(_day_s(cfg) / cfg.profile_bin_s):
                return None
        fc = Forecaster(
            level=float(f["level"]), trend=float(f["trend"]), short=float(f["short"]),
            envelope=float(f["envelope"]), surge=float(f["surge"]),
            bin_start_s=None if f["bin_start_s"] is None else float(f["bin_start_s"]),
            bin_units=float(f["bin_units"]), profiles=profiles, activity=activity,
            spread=float(f["spread"]),
        )  # fmt: skip
        return EmberState(
            forecaster=fc,
            last_t=None if data["last_t"] is None else float(data["last_t"]),
            last_arrival_t=float(data["last_arrival_t"]),
            last_queued=float(data["last_queued"]),
            panic_until=float(data["panic_until"]),
            recent=tuple((float(t), int(v)) for t, v in data["recent"]),
            bursts=tuple((float(t), int(v)) for t, v in data["bursts"]),
        )
    except (KeyError, TypeError, ValueError):
        return None
