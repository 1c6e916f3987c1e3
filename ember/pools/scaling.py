"""The pools controller's autoscalers: per production version the predictive autoscaler
(the same code the simulator replays, ``ember.pools.autoscaler``), the demand the gateway
counted for it since its last step, the tier counts it wants, and what it learned — the
daily profile and the promotion times — saved to and restored from the forecast store
(Redis), so a restarted or newly elected controller goes on from it.

The controller observes its replicas and hands each step its
:class:`~ember.pools.autoscaler.Observation`; this module holds no replica.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, Any

from ember.domain.spec import DeploymentKey
from ember.logs import get_logger, model_context
from ember.pools.autoscaler import (
    Autoscaler,
    EmberConfig,
    EmberState,
    TierCounts,
    ember_autoscaler,
    state_from_dict,
    state_to_dict,
)
from ember.pools.learners import PromotionLearner

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ember.config import Settings
    from ember.pools.demand import DemandKey, ForecastStore
    from ember.serving.routing import DeploymentView

log = get_logger(__name__)


class Autoscalers:
    """Every production version's autoscaler, its demand count and its target, stepped
    every ``every_s``; their state saved every ``state_every_s`` when there is a store."""

    def __init__(
        self,
        knobs: dict[str, Any] | None = None,
        store: ForecastStore | None = None,
        *,
        every_s: float = 1.0,
        state_every_s: float = 10.0,
    ) -> None:
        self.knobs = dict(knobs or {})
        """EmberConfig knobs for every deployment (``idle_hold_s``, ``warm_keep_s``)."""
        self.store = store
        self.every_s = every_s
        self.state_every_s = state_every_s
        self.scalers: dict[DemandKey, Autoscaler[EmberState, EmberConfig]] = {}
        self.targets: dict[DemandKey, TierCounts] = {}
        self.demand: dict[DemandKey, list[float]] = {}
        """Model units arrived and admitted since the version's last step."""
        self.promotion = PromotionLearner()
        """Seconds to serving, per tier promoted from: the autoscaler's lead is their p95
        (PromotionTimes' measured defaults until a tier has samples)."""
        self._promotion_restored = False
        self._state_saved = self._last_step = time.monotonic()

    # --- demand -------------------------------------------------------------------------

    def count(self, key: DemandKey, units: float, *, arrived: bool, admitted: bool) -> None:
        """Units that arrived (once per request) and that were admitted, for ``key``."""
        arrived_admitted = self.demand.setdefault(key, [0.0, 0.0])
        if arrived:
            arrived_admitted[0] += units
        if admitted:
            arrived_admitted[1] += units

    def add(self, theirs: Mapping[DemandKey, list[float]]) -> None:
        """What other processes' gateways counted (the followers', on the leader)."""
        for key, (arrived, admitted) in theirs.items():
            mine = self.demand.setdefault(key, [0.0, 0.0])
            mine[0] += arrived
            mine[1] += admitted

    def take(self, key: DemandKey) -> tuple[float, float]:
        """The version's units arrived and admitted since the last take (for a step)."""
        arrived, admitted = self.demand.pop(key, [0.0, 0.0])
        return arrived, admitted

    def take_all(self) -> dict[DemandKey, list[float]]:
        """Every count, taken (a follower pushes them to the leader)."""
        counted, self.demand = self.demand, {}
        return counted

    # --- stepping -----------------------------------------------------------------------

    def due(self, now: float) -> float | None:
        """The interval since the last step, when a step is due at ``now`` (then it is
        counted as made); ``None`` before."""
        dt = now - self._last_step
        if dt < self.every_s:
            return None
        self._last_step = now
        return dt

    def restart(self) -> None:
        """Elected: what followers counted is no one interval's demand; count afresh."""
        self.demand.clear()
        self._last_step = time.monotonic()

    def config(self, view: DeploymentView) -> EmberConfig:
        return EmberConfig.from_policy(view.policy, tick_s=self.every_s, **self.knobs)

    def scaler(
        self, key: DeploymentKey, view: DeploymentView, version: str
    ) -> Autoscaler[EmberState, EmberConfig]:
        """The version's autoscaler: ``decide`` with the deployment's pool policy. A changed
        policy (new schedules, say) applies from the next step; what it learned stays."""
        scaler = self.scalers.get((key, version))
        config = self.config(view)
        if scaler is not None and scaler.config != config:
            scaler.config = config
        if scaler is None:
            scaler = ember_autoscaler(
                config,
                clock=time.time,  # wall clock: the profiles are times of day, and persist
                model=view.model,
                version=version,
                keep_last=20,
            )
            self.scalers[(key, version)] = scaler
        return scaler

    def standby(self, deployments: Mapping[DeploymentKey, DeploymentView]) -> int:
        """The standby processes the production versions' autoscalers want together."""
        return sum(
            t.standby
            for (key, version), t in self.targets.items()
            if key in deployments and version == deployments[key].production
        )

    # --- learned state ------------------------------------------------------------------

    async def restore(self, deployments: Mapping[DeploymentKey, DeploymentView]) -> None:
        """A production version without an autoscaler yet gets one, its state restored from
        the store when there is one (read in a thread; Redis away: start afresh)."""
        store = self.store
        if store is None:
            return
        if not self._promotion_restored:
            self._promotion_restored = True
            try:
                stored = await asyncio.to_thread(store.load_promotion)
            except Exception:  # Redis away: the defaults until measured here
                stored = {}
            self.promotion.restore(stored)  # what was learned before, then what is now
        for key, view in deployments.items():
            version = view.production
            if version is None or (key, version) in self.scalers:
                continue
            try:
                data = await asyncio.to_thread(store.load, (key, version))
            except Exception:  # Redis away: learn again rather than stop
                log.warning("could not read the autoscaler state", deployment=view.name)
                data = None
            scaler = self.scaler(key, view, version)
            state = None if data is None else state_from_dict(data, scaler.config)
            if state is not None:
                scaler.state = state
                with model_context(view.model, version):
                    log.info("autoscaler state restored", deployment=view.name,
                             level_units_per_s=round(state.forecaster.level, 4))  # fmt: skip

    async def save(
        self, deployments: Mapping[DeploymentKey, DeploymentView], *, force: bool = False
    ) -> None:
        """Save every autoscaler's state and the promotion samples (every
        ``state_every_s``, or now with ``force``); forget the versions the registry no
        longer has."""
        store = self.store
        if store is None or not (self.scalers or deployments):
            return
        if not force and time.monotonic() - self._state_saved < self.state_every_s:
            return
        self._state_saved = time.monotonic()
        # A version the registry no longer has (its deployment deleted, or it removed from
        # the deployment) takes what it learned with it: a deployment created again under
        # the same name starts afresh.
        live = {(key, v) for key, view in deployments.items() for v in view.specs}
        for gone in [k for k in self.scalers if k not in live]:
            del self.scalers[gone]
            self.targets.pop(gone, None)
        states = {k: state_to_dict(s.state) for k, s in self.scalers.items()}

        promotion = {tier: list(xs) for tier, xs in self.promotion.samples.items()}

        def save() -> int:
            store.save(states, promotion)
            return store.keep_only(live)

        try:
            removed = await asyncio.to_thread(save)
        except Exception:  # Redis away: saved at the next try
            log.warning("could not save the autoscaler state")
            return
        if removed:
            log.info("autoscaler state of removed versions forgotten", versions=removed)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    # --- what it shows ------------------------------------------------------------------

    def describe(
        self, key: DeploymentKey, view: DeploymentView | None, *, acting: bool
    ) -> dict[str, Any]:
        """What the autoscaler of the deployment's production version forecast, wants per
        tier and why, the promotion times it plans with and its last decisions (for
        ``GET /v1/deployments/{name}/autoscaler``). ``acting`` is false on a controller
        that follows another (which decides; its view is the leader's to show)."""
        version = view.production if view is not None else None
        scaler = self.scalers.get((key, version)) if version is not None else None
        promotion = self.promotion.times()
        out: dict[str, Any] = {
            "version": version,
            "acting": acting,
            "promotion_s": {"warm": promotion.warm_s, "standby": promotion.standby_s,
                            "cold": promotion.cold_s},
            "promotion_samples": {t: len(v) for t, v in self.promotion.samples.items()},
            "config": None, "forecast": [], "desired": None, "reasons": [], "decisions": [],
        }  # fmt: skip
        if scaler is None:
            return out
        cfg = scaler.config
        out["config"] = {
            "target_utilization": cfg.target_utilization, "forecast_quantile":
            cfg.forecast_quantile, "warm_cost": cfg.warm_cost, "standby_cost": cfg.standby_cost,
            "min_hot": cfg.min_hot, "max_replicas": cfg.max_replicas,
            "profile_periods_s": list(cfg.profile_periods_s),
            "level_units_per_s": _finite(scaler.state.forecaster.level),
        }  # fmt: skip
        if scaler.last:
            _, _, last = scaler.last[-1]
            out["forecast"] = [
                {"tier": s.tier.value, "from": s.source.value, "promotion_s": s.promotion_s,
                 "horizon_s": _finite(s.horizon_s),
                 "units_per_s": _finite(s.forecast_units_per_s), "replicas": s.replicas}
                for s in last.stages
            ]  # fmt: skip
            d = last.desired
            out["desired"] = {"hot": d.hot, "warm": d.warm, "standby": d.standby}
            out["reasons"] = list(last.reasons)
        out["decisions"] = [
            {"at": _finite(t), "hot": d.desired.hot, "warm": d.desired.warm,
             "standby": d.desired.standby, "arrived_units_per_s": _finite(o.arrived_units_per_s),
             "ready": {"hot": o.ready.hot, "warm": o.ready.warm, "standby": o.ready.standby}}
            for t, o, d in scaler.last
        ]  # fmt: skip
        return out


def autoscale_knobs(settings: Settings) -> dict[str, Any]:
    """The ``EmberConfig`` knobs the settings set for every deployment."""
    knobs: dict[str, Any] = {
        "idle_hold_s": settings.scale_idle_hold_s,
        "warm_keep_s": settings.scale_warm_keep_s,
        "warm_cost": settings.scale_warm_cost,
        "standby_cost": settings.scale_standby_cost,
        "forecast_quantile": settings.scale_forecast_quantile,
    }
    period = settings.scale_profile_period_s
    if period != 86_400.0:  # a compressed day (tests, demos): the bins shrink alike ...
        # (no finer than two ticks: a bin a tick does not fill is noise) ...
        defaults = EmberConfig()
        bin_s = max(period / 144, 2.0 * defaults.tick_s)
        knobs |= {"profile_periods_s": (period, 7 * period), "profile_bin_s": bin_s}
        # ... and so do the autoscaler's memories, to no less than five ticks: a day of a
        # minute would otherwise remember a burst, or hold a step down, for longer than
        # the day.
        factor = period / 86_400.0
        for name in COMPRESSED_WINDOWS:
            seconds = knobs.get(name, getattr(defaults, name))
            knobs[name] = min(seconds, max(5.0 * defaults.tick_s, seconds * factor))
    return knobs


COMPRESSED_WINDOWS = (
    "level_tau_s", "trend_tau_s", "burst_decay_s", "stabilization_s", "burst_hold_s",
    "standby_keep_s", "surge_decay_s", "predict_horizon_s",
)  # fmt: skip
"""The ``EmberConfig`` memories a compressed day (``scale_profile_period_s``) shrinks: the
demand's level and trend, how long a burst is remembered or a step down held. The short
window the burst guard follows (``burst_tau_s``, 10 s) is about noise, not the day, and
stays."""


def _finite(x: float) -> float | None:
    """JSON has no NaN or infinity: ``None`` for those."""
    return round(x, 6) if math.isfinite(x) else None
