"""Baseline policies, same shape as :func:`ember.pools.autoscaler.decide`.

- ``knative``: the Knative Pod Autoscaler (KPA) at its documented defaults, in ``rps``
  mode with one replica's capacity (model units/s) as the per-pod target: 60 s stable
  window, 6 s panic window (10 %), panic at 200 %, target utilization 70 %, 2 s tick,
  max scale-up rate 1000, max scale-down rate 2, scale to zero after a stable window
  without traffic plus the 30 s grace period; cold starts only (no warm tier).
- ``ray``: Ray Serve's ``replica_queue_length_autoscaling_policy`` at its defaults:
  ``target_ongoing_requests=2``, ``upscale_delay_s=30``, ``downscale_delay_s=600``,
  ``look_back_period_s=30``, smoothing 1, ``min_replicas=1``; scale from zero at once.
- ``static-peak``: a fixed number of hot replicas, sized for the trace's peak.
- ``reactive-min1``: hot replicas for the last 10 s of demand, at least one, scale-down
  after 60 s; cold starts only.
- ``ray@N``: Ray Serve with ``target_ongoing_requests=N`` (tuned near the batch size, as
  users of batched engines set it).
- ``oracle``: clairvoyant, the **lower bound** on hot capacity: it knows the arrivals and
  starts each replica exactly one cold start before it is needed (no warm tier).
- ``knative+cron``: the KPA plus a scheduled floor per hour of the day (what users of
  KEDA's cron scaler do), switched on one cold start ahead.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ember.pools.autoscaler import Decision, Observation, TierCounts

_EPS = 1e-9
Samples = tuple[tuple[float, float, float], ...]
"""(time, value, seconds covered)."""


def _push(samples: Samples, now: float, value: float, dt: float, span: float) -> Samples:
    return (*(s for s in samples if s[0] > now - span), (now, value, dt))


def _mean_rate(samples: Samples, now: float, span: float) -> float:
    """Units per second over the last ``span`` seconds (each sample covers ``dt``)."""
    total = sum(v * dt for t, v, dt in samples if t > now - span)
    return total / span


# ----------------------------------------------------------------------------- knative


@dataclass(frozen=True, slots=True)
class KnativeConfig:
    target_utilization: float = 0.7
    stable_window_s: float = 60.0
    panic_window_pct: float = 10.0
    panic_threshold: float = 2.0
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    scale_to_zero_grace_s: float = 30.0
    enable_scale_to_zero: bool = True
    min_scale: int = 0
    max_scale: int = 1000
    tick_s: float = 2.0

    @property
    def panic_window_s(self) -> float:
        return self.stable_window_s * self.panic_window_pct / 100.0


@dataclass(frozen=True, slots=True)
class KnativeState:
    samples: Samples = ()
    last_eval_s: float = -math.inf
    desired: int = 0
    panic_since: float | None = None
    max_panic_pods: int = 0
    last_traffic_s: float = -math.inf


def knative(
    obs: Observation, state: KnativeState, cfg: KnativeConfig, now: float
) -> Decision[KnativeState]:
    """KPA (``pkg/autoscaler/scaling/autoscaler.go`` logic, rps metric)."""
    samples = _push(
        state.samples, now, obs.arrived_units_per_s, obs.interval_s, cfg.stable_window_s
    )
    last_traffic = now if obs.arrived_units_per_s > 0 else state.last_traffic_s
    ready = obs.ready.hot
    current = ready + obs.promoting
    activate = current == 0 and obs.arrived_units_per_s > 0  # the activator pokes at once
    if now < state.last_eval_s + cfg.tick_s - _EPS and not activate:
        st = KnativeState(samples, state.last_eval_s, state.desired, state.panic_since,
                          state.max_panic_pods, last_traffic)  # fmt: skip
        return Decision(TierCounts(hot=state.desired), st, ("between ticks",),
                        next_eval_s=state.last_eval_s + cfg.tick_s)  # fmt: skip
    per_pod = max(obs.capacity_units_per_s, _EPS) * cfg.target_utilization
    stable = _mean_rate(samples, now, cfg.stable_window_s)
    panic = _mean_rate(samples, now, cfg.panic_window_s)
    want_stable = math.ceil(stable / per_pod - _EPS)
    want_panic = math.ceil(panic / per_pod - _EPS)
    base = max(ready, 1)
    up_limit = math.ceil(cfg.max_scale_up_rate * base)
    down_limit = math.floor(base / cfg.max_scale_down_rate)
    want_stable = min(max(want_stable, down_limit if ready else 0), up_limit)
    want_panic = min(max(want_panic, down_limit if ready else 0), up_limit)
    over = want_panic / base >= cfg.panic_threshold
    panic_since = state.panic_since
    reasons = [
        f"stable {stable:.3g} u/s -> {want_stable}",
        f"panic {panic:.3g} u/s -> {want_panic}",
    ]
    if over:
        panic_since = now
    elif panic_since is not None and now >= panic_since + cfg.stable_window_s:
        panic_since = None
    max_panic = state.max_panic_pods
    if panic_since is not None:
        desired = max(want_panic, max_panic)
        max_panic = desired
        reasons.append("panic mode: no scale-down")
    else:
        desired, max_panic = want_stable, 0
    if activate:
        desired = max(desired, 1)
        reasons.append("activator: scale from zero")
    if desired == 0 and current > 0:
        idle_since = last_traffic + cfg.stable_window_s
        if not cfg.enable_scale_to_zero or now < idle_since + cfg.scale_to_zero_grace_s:
            desired = max(current, 1)
            reasons.append("scale-to-zero grace period")
    desired = min(max(desired, cfg.min_scale), cfg.max_scale)
    st = KnativeState(samples, now, desired, panic_since, max_panic, last_traffic)
    return Decision(TierCounts(hot=desired), st, tuple(reasons), stable, 0.0,
                    _knative_next(obs, st, cfg, now))  # fmt: skip


def _knative_next(obs: Observation, st: KnativeState, cfg: KnativeConfig, now: float) -> float:
    traffic = any(v > 0 for _, v, _ in st.samples)
    if st.panic_since is not None or obs.promoting or obs.queued_units > _EPS:
        return now + cfg.tick_s
    if traffic:
        if obs.ready.hot > 1:
            return now + cfg.tick_s
        return st.last_traffic_s + cfg.stable_window_s  # one pod: nothing changes before
    if obs.ready.hot == 0:
        return math.inf
    return max(
        now + cfg.tick_s, st.last_traffic_s + cfg.stable_window_s + cfg.scale_to_zero_grace_s
    )


# --------------------------------------------------------------------------------- ray


@dataclass(frozen=True, slots=True)
class RayConfig:
    target_ongoing_requests: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 100
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    smoothing_factor: float = 1.0
    tick_s: float = 1.0


@dataclass(frozen=True, slots=True)
class RayState:
    samples: Samples = ()
    target: int = 0
    up_since: float | None = None
    down_since: float | None = None


def ray(obs: Observation, state: RayState, cfg: RayConfig, now: float) -> Decision[RayState]:
    """Ray Serve ``replica_queue_length_autoscaling_policy`` with its delay logic."""
    ongoing = obs.inflight_requests + obs.queued_requests
    samples = _push(state.samples, now, ongoing, obs.interval_s, cfg.look_back_period_s)
    span = min(cfg.look_back_period_s, max(sum(dt for _, _, dt in samples), _EPS))
    total = _mean_rate(samples, now, span)
    current = state.target if state.target else obs.ready.hot + obs.promoting
    if current == 0:
        desired = 1 if total > 0 else 0
    else:
        error = (total / current) / cfg.target_ongoing_requests
        desired = math.ceil(current * (1 + (error - 1) * cfg.smoothing_factor) - _EPS)
    desired = min(max(desired, cfg.min_replicas), cfg.max_replicas)
    up_since, down_since = state.up_since, state.down_since
    target = current
    reasons = [f"ongoing {total:.3g} req / target {cfg.target_ongoing_requests:g} -> {desired}"]
    if current == 0 and desired > 0:
        target = desired
        reasons.append("scale from zero")
    elif desired > current:
        up_since = now if up_since is None else up_since
        down_since = None
        if now - up_since >= cfg.upscale_delay_s:
            target, up_since = desired, None
        else:
            reasons.append(f"upscale delay {now - up_since:.0f}/{cfg.upscale_delay_s:g}s")
    elif desired < current:
        down_since = now if down_since is None else down_since
        up_since = None
        if now - down_since >= cfg.downscale_delay_s:
            target, down_since = desired, None
        else:
            reasons.append(f"downscale delay {now - down_since:.0f}/{cfg.downscale_delay_s:g}s")
    else:
        up_since = down_since = None
    st = RayState(samples, target, up_since, down_since)
    quiet = total <= _EPS and target <= cfg.min_replicas and up_since is None
    nxt = math.inf if quiet and down_since is None else now + cfg.tick_s
    if quiet and down_since is not None:
        nxt = down_since + cfg.downscale_delay_s
    return Decision(TierCounts(hot=target), st, tuple(reasons), total, 0.0, nxt)


# ------------------------------------------------------------------------------ static


@dataclass(frozen=True, slots=True)
class StaticConfig:
    hot: int = 1


def static(obs: Observation, state: None, cfg: StaticConfig, now: float) -> Decision[None]:
    return Decision(TierCounts(hot=cfg.hot), None, (f"static {cfg.hot} hot",))


# ---------------------------------------------------------------------------- reactive


@dataclass(frozen=True, slots=True)
class ReactiveConfig:
    target_utilization: float = 0.7
    window_s: float = 10.0
    stabilization_s: float = 60.0
    drain_s: float = 2.0
    min_hot: int = 1
    max_replicas: int = 100
    tick_s: float = 1.0


@dataclass(frozen=True, slots=True)
class ReactiveState:
    samples: Samples = ()
    recent: tuple[tuple[float, int], ...] = ()


def reactive(
    obs: Observation, state: ReactiveState, cfg: ReactiveConfig, now: float
) -> Decision[ReactiveState]:
    """Size for the last ``window_s`` of demand (and the queue); hold for ``stabilization_s``."""
    samples = _push(state.samples, now, obs.arrived_units_per_s, obs.interval_s, cfg.window_s)
    demand = _mean_rate(samples, now, cfg.window_s)
    cap = max(obs.capacity_units_per_s, _EPS)
    want = math.ceil(
        demand / (cap * cfg.target_utilization) + obs.queued_units / cfg.drain_s / cap - _EPS
    )
    want = min(max(want, cfg.min_hot), cfg.max_replicas)
    recent = tuple(e for e in state.recent if e[0] > now - cfg.stabilization_s)
    recent = (*(e for e in recent if e[1] > want), (now, want))
    hot = max(v for _, v in recent)
    st = ReactiveState(samples, recent)
    idle = demand <= _EPS and obs.queued_units <= _EPS and hot == want
    return Decision(TierCounts(hot=hot), st, (f"demand {demand:.3g} u/s -> {want}",), demand,
                    0.0, math.inf if idle and not obs.promoting else now + cfg.tick_s)  # fmt: skip


# ------------------------------------------------------------------------------ oracle


@dataclass(frozen=True, slots=True)
class OracleConfig:
    """A clairvoyant policy's plan, computed from the arrivals it will see: ``hot[k]``
    replicas wanted in tick ``k`` (see :func:`oracle_plan`), ``next_change[k]`` the first
    tick after ``k`` whose plan differs."""

    hot: tuple[int, ...]
    next_change: tuple[int, ...]
    tick_s: float = 1.0


def oracle_plan(
    units_per_tick: Sequence[float], capacity_units_per_s: float, *, cold_s: float,
    slo_wait_s: float, tick_s: float = 1.0, min_hot: int = 0,
) -> OracleConfig:  # fmt: skip
    """The lower bound on hot capacity: a tick needs the replicas that serve the work
    arriving within one SLO wait at full utilization; each is started exactly one cold
    start before it is needed and kept only while it is needed within one cold start
    (stopping it sooner would mean starting it again). No warm or standby tier."""
    n = len(units_per_tick)
    window = max(1, round(slo_wait_s / tick_s))
    need = [0] * n
    acc = 0.0
    for k in range(n - 1, -1, -1):  # work arriving in [k, k + window) over the window
        acc += units_per_tick[k]
        if k + window < n:
            acc -= units_per_tick[k + window]
        rate = max(acc, 0.0) / (window * tick_s)
        need[k] = max(min_hot, math.ceil(rate / capacity_units_per_s - _EPS) if rate > _EPS else 0)
    ahead = max(0, math.ceil(cold_s / tick_s))
    hot = _window_max(need, ahead)
    nxt = [n] * n
    for k in range(n - 2, -1, -1):
        nxt[k] = k + 1 if hot[k + 1] != hot[k] else nxt[k + 1]
    return OracleConfig(tuple(hot), tuple(nxt), tick_s)


def _window_max(xs: list[int], ahead: int) -> list[int]:
    """``out[k] = max(xs[k : k + ahead + 1])`` (a monotonic deque)."""
    out = [0] * len(xs)
    dq: deque[int] = deque()
    for k in range(len(xs) - 1, -1, -1):
        while dq and xs[dq[-1]] <= xs[k]:
            dq.pop()
        dq.append(k)
        while dq[0] > k + ahead:
            dq.popleft()
        out[k] = xs[dq[0]]
    return out


def oracle(obs: Observation, state: None, cfg: OracleConfig, now: float) -> Decision[None]:
    """Clairvoyant (documented as the lower bound): follow the precomputed plan."""
    if not cfg.hot:
        return Decision(TierCounts(), None, ("oracle: no arrivals",))
    k = min(int(now // cfg.tick_s), len(cfg.hot) - 1)
    nxt = cfg.next_change[k] * cfg.tick_s if cfg.next_change[k] < len(cfg.hot) else math.inf
    return Decision(TierCounts(hot=cfg.hot[k]), None, (f"oracle: {cfg.hot[k]} hot",),
                    next_eval_s=nxt)  # fmt: skip


# ------------------------------------------------------------------------- knative+cron


@dataclass(frozen=True, slots=True)
class CronFloorConfig:
    """KPA plus a scheduled floor, as users of KEDA's cron scaler set one: ``floor[h]`` hot
    replicas from hour ``h`` of the day on, switched on ``lead_s`` early (one cold start:
    the user schedules it ahead of the hour)."""

    knative: KnativeConfig
    floor: tuple[int, ...]
    lead_s: float = 0.0
    slot_s: float = 3600.0
    period_s: float = 86_400.0


def cron_floor(
    units_per_s_by_slot: Sequence[float], capacity_units_per_s: float, utilization: float
) -> tuple[int, ...]:
    """The floor a user would schedule from their traffic's profile: each slot's mean
    demand at the target utilization."""
    per = max(capacity_units_per_s * utilization, _EPS)
    return tuple(math.ceil(u / per - _EPS) if u > _EPS else 0 for u in units_per_s_by_slot)


def knative_cron(
    obs: Observation, state: KnativeState, cfg: CronFloorConfig, now: float
) -> Decision[KnativeState]:
    """KPA, never below the floor scheduled for ``now + lead_s``."""
    d = knative(obs, state, cfg.knative, now)
    if not cfg.floor:
        return d
    slot = int(((now + cfg.lead_s) % cfg.period_s) // cfg.slot_s) % len(cfg.floor)
    floor = cfg.floor[slot]
    if floor <= d.desired.hot:
        return d
    edge = (math.floor((now + cfg.lead_s) / cfg.slot_s) + 1) * cfg.slot_s - cfg.lead_s
    return Decision(TierCounts(hot=floor), d.state, (*d.reasons, f"cron floor {floor}"),
                    d.forecast_units_per_s, 0.0, min(d.next_eval_s, edge))  # fmt: skip
