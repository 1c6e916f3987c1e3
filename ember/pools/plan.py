"""From tier targets to what to do: the scaling layer the controller and the simulator share.

:func:`~ember.pools.autoscaler.decide` says how many replicas each tier should hold;
this module says what that means for the replicas there are — how many to start, promote,
demote and stop — in counts, with no I/O and no clock. In the live controller
(:class:`~ember.pools.controller.PoolsController`) its replicas count an :class:`Inventory`
per version (:meth:`~ember.pools.inventory.ReplicaInventory.inventory`), the controller
calls :func:`plan`, and its actions carry the :class:`Actions` out
(:meth:`~ember.pools.actions.ReplicaActions.act`, picking which replicas: the least
loaded, then the newest); the simulator (:mod:`ember.pools.simulator`) calls the same
function on its counts and carries them out on its model of time, so what
``ember simulate`` replays is what runs.

The rules, in the order they apply:

1. **Hot short** (fewer ready + coming hot replicas than the target): promote ready warm
   ones first (one host-to-device copy), then keep warm spares still loading hot, then
   start new replicas (the backend takes a standby process when one is free, else a cold
   start). Nothing starts for a version that crash-loops.
2. **Hot over**: starts on their way beyond the target are cancelled first (the newest;
   a promotion from warm is not); then ready hot replicas over the target are demoted to
   warm while the warm tier (ready and being demoted) is below its target, and the rest
   stopped.
3. **Warm short**, with ``fill_warm``: start warm spares (loaded, then demoted) for what
   rules 1 and 2 leave missing.
4. **Warm over** (counting spares still loading): cancel spares still loading first,
   then stop ready warm replicas.

Every step down (rules 2, 4, 5) waits until every version the deployment serves has a
ready hot replica (``may_retire``), so a rollout never leaves a gap.
5. **A version no longer served** (not in the deployment's traffic, fallback or pinned
   versions): stop everything it has, starting ones included, once ``may_retire``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Inventory:
    """One version's replicas by state, as counts."""

    hot: int = 0
    """Ready and hot (serving)."""
    warm: int = 0
    """Ready and warm (weights in host memory)."""
    starting_hot: int = 0
    """On the way to hot: starting (cold or from a standby process) or promoting."""
    promoting: int = 0
    """Of ``starting_hot``, those being promoted from warm (one copy; not cancelled)."""
    starting_warm: int = 0
    """Warm spares still loading (started to be demoted to warm once loaded)."""
    demoting: int = 0
    """Hot -> warm under way."""


@dataclass(frozen=True)
class Target:
    """What one version should hold. ``serving=False``: it no longer serves (rule 5)."""

    hot: int
    warm: int = 0
    serving: bool = True


@dataclass(frozen=True)
class Actions:
    """What to do for one version, in counts."""

    start_hot: int = 0
    """New replicas that serve once ready."""
    start_warm: int = 0
    """New replicas demoted to warm once loaded."""
    promote: int = 0
    """Ready warm -> hot."""
    keep_hot: int = 0
    """Warm spares still loading that stay hot instead."""
    cancel_hot: int = 0
    """Starts on their way to hot that are stopped (the newest first): the target fell
    below what is ready and coming."""
    demote: int = 0
    """Ready hot -> warm."""
    stop_hot: int = 0
    stop_warm: int = 0
    stop_starting: int = 0
    """Replicas on their way that are stopped: warm spares still loading that the warm
    tier no longer needs; for a version no longer served, everything on its way."""

    def __bool__(self) -> bool:
        return any(getattr(self, f) for f in self.__dataclass_fields__)


def hot_target(
    autoscaled: int | None,
    *,
    floor: int,
    weight: int,
    production: bool,
    woken: bool,
    max_replicas: int,
) -> int:
    """Hot replicas for one version of a deployment.

    The production version takes the autoscaler's figure (``autoscaled``), never below the
    floor (``min_hot``, and at least one unless the deployment scales to zero); another
    version with traffic (a canary) a proportional share of the floor, at least one when
    the floor is. A scaled-to-zero version a request woke holds one. Never above
    ``max_replicas``."""
    if production and autoscaled is not None:
        want = max(floor, autoscaled)
    else:
        want = max(1 if floor else 0, math.ceil(floor * weight / 100))
    if woken:
        want = max(want, 1)
    return min(max_replicas, want)


def plan(
    inv: Inventory,
    target: Target,
    *,
    fill_warm: bool,
    may_retire: bool,
    crash_looping: bool = False,
) -> Actions:
    """What to do for one version (the rules in the module's docstring)."""
    if not target.serving:
        if not may_retire:
            return Actions()
        return Actions(
            stop_hot=inv.hot,
            stop_warm=inv.warm,
            stop_starting=inv.starting_hot + inv.starting_warm + inv.demoting,
        )
    promote = keep_hot = start_hot = 0
    short = target.hot - (inv.hot + inv.starting_hot)
    if short > 0 and not crash_looping:
        promote = min(short, inv.warm)
        keep_hot = min(short - promote, inv.starting_warm)
        start_hot = short - promote - keep_hot
    warm_ready = inv.warm - promote
    loading = inv.starting_warm - keep_hot
    over_hot = max(0, inv.hot - target.hot)
    # Ready hot replicas over the target fill warm before spares still loading do.
    to_warm = min(over_hot, max(0, target.warm - warm_ready - inv.demoting))
    warm_total = warm_ready + inv.demoting + to_warm + loading
    start_warm = 0
    if fill_warm and not crash_looping:
        start_warm = max(0, target.warm - warm_total)
    demote = stop_hot = cancel_hot = cancel_warm = stop_warm = 0
    if may_retire:
        coming = inv.starting_hot - inv.promoting
        cancel_hot = min(coming, max(0, inv.hot + inv.starting_hot - target.hot))
        demote, stop_hot = to_warm, over_hot - to_warm
        cancel_warm = max(0, min(loading, warm_total - target.warm))
        stop_warm = max(0, min(warm_ready, warm_total - cancel_warm - target.warm))
    return Actions(
        start_hot=start_hot,
        start_warm=start_warm,
        promote=promote,
        keep_hot=keep_hot,
        cancel_hot=cancel_hot,
        demote=demote,
        stop_hot=stop_hot,
        stop_warm=stop_warm,
        stop_starting=cancel_warm,
    )


def all_ready(wanted: dict[str, int], ready_hot: dict[str, int]) -> bool:
    """Whether every version that should hold a hot replica has a ready one: only then
    does anything of the deployment stop or step down (``may_retire``)."""
    return all(ready_hot.get(v, 0) > 0 for v, want in wanted.items() if want > 0)


def standby_pool_size(sized: int, wanted: int, *, floor: int, maximum: int) -> int:
    """The shared standby pool: what its asks sized it to (``size_standby_pool``) or the
    standby replicas the deployments' autoscalers want together, whichever is more,
    between the floor and the maximum."""
    return max(floor, min(maximum, max(sized, wanted)))
