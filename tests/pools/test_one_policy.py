"""One policy, replayed whole: the simulator and the live pools controller run the same
tier counts (``decide``) *and* the same scaling layer (``ember.pools.plan``) over them.
The simulator replays a trace and records every step; the controller, given the same
observations and holding the replicas the simulator held at each step, decides the same
tier counts, plans the same actions and carries them out on its replicas."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from ember.pools.autoscaler import PromotionTimes
from ember.pools.backends.base import ReplicaHandle
from ember.pools.controller import PoolsController
from ember.pools.inventory import ManagedReplica
from ember.pools.plan import Actions, Inventory, Target, hot_target, plan
from ember.pools.replay import Deployment, make_autoscaler
from ember.pools.replica_control import ReplicaControl
from ember.pools.simulator import SimConfig, simulate
from ember.pools.traces import synthetic
from ember.registry.schemas import PoolPolicy
from tests.pools.test_controller_autoscale import COST, KEY, FakeBackend, view

POLICY = {"min_hot": 1, "max_replicas": 20, "target_utilization": 0.7}


def _hold(ctl: PoolsController, inv: Inventory, ids: itertools.count[int]) -> None:
    """Give the controller the replicas ``inv`` counts (and nothing else)."""
    ctl.replicas.clear()

    def add(n: int, state: str, tier: str, then_tier: str | None = None) -> None:
        for _ in range(n):
            handle = ReplicaHandle(f"s{next(ids)}", "http://replica")
            ctl.replicas[handle.replica_id] = ManagedReplica(
                handle, KEY, "m", "1", state=state, tier=tier, then_tier=then_tier
            )

    add(inv.hot, "ready", "hot")
    add(inv.warm, "ready", "warm")
    add(inv.starting_hot - inv.promoting, "starting", "hot")
    add(inv.promoting, "promoting", "warm")
    add(inv.starting_warm, "starting", "hot", then_tier="warm")
    add(inv.demoting, "demoting", "hot")


def _after(inv: Inventory, a: Actions) -> Inventory:
    """The inventory once ``a`` is under way (promotions and demotions in flight)."""
    return Inventory(
        hot=inv.hot - a.demote - a.stop_hot,
        warm=inv.warm - a.promote - a.stop_warm,
        starting_hot=inv.starting_hot + a.promote + a.keep_hot + a.start_hot - a.cancel_hot,
        promoting=inv.promoting + a.promote,
        starting_warm=inv.starting_warm - a.keep_hot + a.start_warm - a.stop_starting,
        demoting=inv.demoting + a.demote,
    )


@pytest.mark.parametrize("fill_warm", [True, False])
def test_the_controller_plans_and_acts_as_the_simulator_replays_tick_by_tick(
    fill_warm: bool,
) -> None:
    asyncio.run(_replay(fill_warm))


async def _replay(fill_warm: bool) -> None:
    tr = synthetic(7, 3600.0, 6.0, period_s=1200.0, bursts=3)
    policy = PoolPolicy(**POLICY)
    sim_scaler = make_autoscaler("ember", tr, Deployment(**POLICY), COST)
    sim = SimConfig(
        cost_model=COST,
        promotion=PromotionTimes(),
        fill_warm=fill_warm,
        hot_floor=policy.hot_floor,
        max_replicas=policy.max_replicas,
        record_plans=True,
    )
    steps = simulate(tr, sim_scaler, sim).plans
    assert len(steps) > 3000

    ok = httpx.MockTransport(lambda request: httpx.Response(200, json={}))
    ctl = PoolsController(None, FakeBackend(), standby_pool=0, fill_warm=fill_warm)  # type: ignore[arg-type]
    ctl.actions.replica_api = ReplicaControl(httpx.AsyncClient(transport=ok))
    ctl.deployments = {KEY: view(**POLICY)}
    live = ctl.scaler(KEY, ctl.deployments[KEY], "1")
    live.log_decisions = False
    ids = itertools.count()
    seen: dict[str, int] = {}
    for step in steps:
        _hold(ctl, step.inventory, ids)
        decision = live.step(step.observation, step.at)
        assert decision.desired == step.desired, step.at
        ctl.targets[(KEY, "1")] = decision.desired
        inv, target, actions = ctl.plans(KEY)["1"]
        assert (inv, target, actions) == (step.inventory, step.target, step.actions), step.at
        ctl._carry_out()
        assert ctl.inventory(KEY, "1") == _after(inv, actions), (step.at, inv, actions)
        await asyncio.gather(*ctl.actions._assigning)
        for name in Actions.__dataclass_fields__:
            seen[name] = seen.get(name, 0) + getattr(actions, name)
    await ctl.actions.replica_api.aclose()
    # The trace made it do everything it can do, not only idle at the floor.
    wanted = {"start_hot", "promote", "demote", "stop_hot", "cancel_hot"} | (
        {"start_warm"} if fill_warm else set()
    )
    assert all(seen[name] > 0 for name in wanted), seen


def test_a_canary_takes_a_share_of_the_floor_and_a_woken_version_one() -> None:
    assert hot_target(5, floor=4, weight=90, production=True, woken=False, max_replicas=8) == 5
    assert hot_target(1, floor=4, weight=90, production=True, woken=False, max_replicas=8) == 4
    assert hot_target(None, floor=4, weight=10, production=False, woken=False, max_replicas=8) == 1
    assert hot_target(None, floor=4, weight=60, production=False, woken=False, max_replicas=8) == 3
    assert hot_target(0, floor=0, weight=100, production=True, woken=True, max_replicas=8) == 1
    assert hot_target(12, floor=1, weight=100, production=True, woken=False, max_replicas=8) == 8


def test_hot_short_promotes_warm_then_keeps_loading_spares_then_starts() -> None:
    inv = Inventory(hot=1, warm=1, starting_warm=1)
    a = plan(inv, Target(hot=5, warm=0), fill_warm=True, may_retire=True)
    assert (a.promote, a.keep_hot, a.start_hot) == (1, 1, 2)
    looping = plan(inv, Target(5, 1), fill_warm=True, may_retire=True, crash_looping=True)
    assert (looping.start_hot, looping.promote, looping.keep_hot, looping.start_warm) == (0,) * 4


def test_hot_over_fills_warm_then_stops_and_waits_for_a_ready_rollout() -> None:
    inv = Inventory(hot=4, warm=1)
    a = plan(inv, Target(hot=1, warm=2), fill_warm=False, may_retire=True)
    assert (a.demote, a.stop_hot, a.stop_warm) == (1, 2, 0)
    assert plan(inv, Target(hot=1, warm=2), fill_warm=False, may_retire=False) == Actions()
    # Starts on their way beyond the target are cancelled first; promotions are not.
    coming = Inventory(hot=1, starting_hot=3, promoting=1)
    assert plan(coming, Target(2), fill_warm=False, may_retire=True) == Actions(cancel_hot=2)
    assert plan(coming, Target(2), fill_warm=False, may_retire=False) == Actions()


def test_warm_over_cancels_loading_spares_before_ready_ones() -> None:
    inv = Inventory(hot=1, warm=2, starting_warm=2)
    a = plan(inv, Target(hot=1, warm=1), fill_warm=True, may_retire=True)
    assert (a.stop_starting, a.stop_warm, a.start_warm) == (2, 1, 0)
    short = plan(
        Inventory(hot=1, warm=1, demoting=1), Target(1, 4), fill_warm=True, may_retire=True
    )
    assert short.start_warm == 2  # the one being demoted counts


def test_a_version_no_longer_served_stops_everything_once_the_rollout_is_ready() -> None:
    inv = Inventory(hot=2, warm=1, starting_hot=1, starting_warm=1, demoting=1)
    gone = Target(0, serving=False)
    assert plan(inv, gone, fill_warm=True, may_retire=False) == Actions()
    assert plan(inv, gone, fill_warm=True, may_retire=True) == Actions(
        stop_hot=2, stop_warm=1, stop_starting=3
    )
