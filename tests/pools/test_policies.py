"""Baselines at their documented defaults."""

from __future__ import annotations

import math

from ember.pools import policies as pol
from tests.pools.conftest import CAP, obs


def test_knative_stable_window_average() -> None:
    cfg, st = pol.KnativeConfig(), pol.KnativeState()
    for t in range(1, 61):  # 60 s at 28 u/s with 3 ready pods
        dec = pol.knative(obs(28.0, hot=3), st, cfg, float(t))
        st = dec.state
    assert dec.desired.hot == math.ceil(28.0 / (CAP * 0.7))  # 28 / 5.6 = 5


def test_knative_panics_at_twice_the_ready_pods() -> None:
    cfg, st = pol.KnativeConfig(), pol.KnativeState()
    for t in range(1, 7):  # 6 s panic window at 4x one pod's target
        dec = pol.knative(obs(4 * CAP * 0.7, hot=1), st, cfg, float(t))
        st = dec.state
    # panic window average 22.4 over 6 s, stable window 22.4 * 6 / 60: panic wins
    assert dec.state.panic_since is not None and dec.desired.hot == 4


def test_knative_scales_to_zero_after_window_plus_grace() -> None:
    cfg = pol.KnativeConfig()
    st = pol.knative(obs(1.0, hot=1), pol.KnativeState(), cfg, 0.0).state
    last = None
    for t in range(2, 120, 2):
        dec = pol.knative(obs(0.0, hot=1, dt=2.0), st, cfg, float(t))
        st = dec.state
        if dec.desired.hot == 0 and last is None:
            last = t
    assert last == 60 + 30  # stable window without traffic + scale-to-zero grace


def test_ray_upscale_and_downscale_delays() -> None:
    cfg, st = pol.RayConfig(), pol.RayState(target=1)
    ups = []
    for t in range(1, 40):  # 8 ongoing requests on 1 replica, target 2 -> 4 replicas
        dec = pol.ray(obs(8.0, hot=1), st, cfg, float(t))
        st = dec.state
        ups.append(dec.desired.hot)
    assert ups.index(4) + 1 == 1 + 30  # after upscale_delay_s
    downs = []
    for t in range(40, 700):
        dec = pol.ray(obs(0.0, hot=4), st, cfg, float(t))
        st = dec.state
        downs.append(dec.desired.hot)
    # The 30 s look-back still holds the 8s: at t its mean is 8 (69 - t) / 30, which asks
    # for fewer than 4 replicas (< 6 ongoing) from t = 47; then downscale_delay_s passes.
    assert downs[0] == 4 and downs.index(1) + 40 == 47 + 600  # to min_replicas = 1


def test_reactive_min1_and_static() -> None:
    st = pol.ReactiveState()
    dec = pol.reactive(obs(0.0, hot=0), st, pol.ReactiveConfig(), 1.0)
    assert dec.desired.hot == 1
    assert pol.static(obs(99.0), None, pol.StaticConfig(hot=7), 1.0).desired.hot == 7
