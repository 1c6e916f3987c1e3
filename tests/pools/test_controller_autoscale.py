"""The pools controller's side of autoscaling: it runs the simulator's policy with the
simulator's configuration, builds its observation from its replicas, learns promotion
times per tier and (with ``fill_warm``) starts warm spares. A fake backend and a mocked
replica HTTP API stand in for processes."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import httpx

from ember.costmodel import CostModel
from ember.domain.spec import STANDBY_POOL, DeploymentKey, ReplicaState, Source, Tier, VersionSpec
from ember.pools.autoscaler import PromotionTimes, TierCounts, decide
from ember.pools.backends.base import LaunchOptions, ReplicaBackend, ReplicaHandle
from ember.pools.controller import PoolsController
from ember.pools.inventory import ManagedReplica
from ember.pools.replay import Deployment, make_autoscaler
from ember.pools.replica_control import ReplicaControl
from ember.pools.simulator import SimConfig, simulate
from ember.pools.traces import synthetic
from ember.registry.schemas import PoolPolicy
from ember.serving.routing import DeploymentView

KEY = DeploymentKey(1, "m")
COST = CostModel(alpha=0.0, beta=0.0, gamma=1.0, capacity_units_per_s=8.0)


class FakeBackend(ReplicaBackend):
    def __init__(self) -> None:
        self.launched: list[VersionSpec | None] = []
        self.options: list[LaunchOptions] = []
        self._ids = itertools.count(1)

    def launch(self, spec: VersionSpec | None, options: LaunchOptions) -> ReplicaHandle:
        self.launched.append(spec)
        self.options.append(options)
        n = next(self._ids)
        return ReplicaHandle(f"r{n}", f"http://replica-{n}")

    def exited(self, handle: ReplicaHandle) -> int | None:
        return None

    def stop(self, handle: ReplicaHandle, grace_s: float = 10.0) -> None:
        pass

    def kill(self, handle: ReplicaHandle) -> None:
        pass


def view(**policy: Any) -> DeploymentView:
    spec = VersionSpec(model="m", version="1", artifact_uri="file:///m", sha256="",
                       engine="torch", cost=COST.to_dict())  # fmt: skip
    return DeploymentView(1, "m", "m", {"1": 100}, PoolPolicy(**policy), {"1": spec}, [])


def controller(**kwargs: Any) -> tuple[PoolsController, FakeBackend]:
    backend = FakeBackend()
    return PoolsController(None, backend, standby_pool=0, **kwargs), backend  # type: ignore[arg-type]


def test_the_controller_and_the_simulator_decide_alike() -> None:
    # The simulator replays a trace with the policy ``ember simulate`` builds for a
    # deployment; the controller's autoscaler for the same pool policy, fed the same
    # observations at the same times, makes the same decisions, reasons included.
    policy = {"min_hot": 1, "max_replicas": 20, "target_utilization": 0.7}
    tr = synthetic(3, 3600.0, 6.0, period_s=1200.0, bursts=2)
    sim_scaler = make_autoscaler("ember", tr, Deployment(**policy), COST)
    sim_scaler.history = []
    simulate(tr, sim_scaler, SimConfig(cost_model=COST, promotion=PromotionTimes()))
    assert len(sim_scaler.history) > 3000

    ctl, _ = controller()
    live = ctl.scaler(KEY, view(**policy), "1")
    assert live.policy is decide and live.config == sim_scaler.config
    live.log_decisions = False
    changes = 0
    for now, observation, decision in sim_scaler.history:
        assert live.step(observation, now) == decision
        changes += decision.desired != TierCounts(hot=1, warm=2)
    assert changes > 100  # the trace made it scale, not only idle at the floor


def test_the_observation_counts_tiers_and_promotions_from_the_replicas() -> None:
    ctl, _ = controller()
    v = view(min_hot=1)

    def replica(n: int, key: DeploymentKey, state: str, tier: str, **kw: Any) -> None:
        handle = ReplicaHandle(f"x{n}", f"http://x{n}")
        ctl.replicas[handle.replica_id] = ManagedReplica(
            handle, key, "m", "" if key.standby_pool else "1",
            state=ReplicaState(state), tier=Tier(tier), **kw,
        )  # fmt: skip

    replica(1, KEY, "ready", "hot")
    replica(2, KEY, "ready", "warm")
    replica(3, KEY, "promoting", "warm")  # warm -> hot under way
    replica(4, KEY, "starting", "hot")  # a scale-up
    replica(5, KEY, "starting", "hot", then_tier="warm")  # a warm spare: not promoting
    replica(6, STANDBY_POOL, "standby", "standby")  # the shared standby pool
    ctl.record_demand(KEY, "1", 16.0, admitted=True)
    obs = ctl.observation(KEY, v, "1", dt=2.0)
    assert obs.ready == TierCounts(hot=1, warm=1, standby=1)
    assert obs.promoting == 2
    assert obs.arrived_units_per_s == 8.0 and obs.capacity_units_per_s == 8.0
    assert obs.promotion == PromotionTimes()  # nothing measured yet: the measured defaults


def test_promotion_times_are_learned_per_tier() -> None:
    ctl, _ = controller()
    for s in (6.0, 7.0, 20.0):
        ctl.promotion.record(Source.cold, s)
    ctl.promotion.record(Source.warm, 0.3)
    times = ctl.promotion.times()
    assert times.cold_s == 7.0  # p95 of three samples: the second largest
    assert times.warm_s == 0.3
    assert times.standby_s == PromotionTimes().standby_s  # not measured: the default
    ctl.promotion.samples[Source.cold], ctl.promotion.samples[Source.warm] = [1.5], []
    fast = ctl.promotion.times()  # a fast host: no tier is slower than the next one
    assert fast == PromotionTimes(warm_s=0.6, standby_s=1.5, cold_s=1.5)


def test_warm_spares_are_started_loaded_then_demoted() -> None:
    asyncio.run(_warm_spares())


async def _warm_spares() -> None:
    tiers: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/info":
            return httpx.Response(200, json={"state": "ready", "tier": "hot"})
        if request.url.path == "/tier":
            tiers.append((request.url.host, request.read().decode()))
            return httpx.Response(200, json={})
        return httpx.Response(404)

    ctl, backend = controller(fill_warm=True)
    ctl.actions.replica_api = ReplicaControl(
        httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )
    v = view(min_hot=1, max_replicas=10)
    ctl.deployments = {KEY: v}
    ctl.targets[(KEY, "1")] = TierCounts(hot=1, warm=2)
    ctl._carry_out()
    # One hot replica and two warm spares are starting.
    starting = [r for r in ctl.replicas.values() if r.state == "starting"]
    assert len(backend.launched) == 3
    assert sorted(str(r.then_tier) for r in starting) == ["None", "warm", "warm"]
    ctl._carry_out()
    assert len(backend.launched) == 3  # the spares on their way count: no more starts

    # A scale-up while the spares load takes one of them instead of a new process, and
    # starts the missing spare.
    ctl.targets[(KEY, "1")] = TierCounts(hot=2, warm=2)
    (_, _, actions) = ctl.plans(KEY)["1"]
    assert (actions.keep_hot, actions.start_hot, actions.start_warm) == (1, 0, 1)
    ctl._carry_out()
    assert sum(1 for r in ctl.replicas.values() if r.then_tier == "warm") == 2
    assert len(backend.launched) == 4

    await ctl.actions.check_starting()  # all loaded: the spares are demoted, the others serve
    await asyncio.gather(*ctl.actions._assigning)
    by_tier = sorted((r.tier, r.state, r.route is not None) for r in ctl.replicas.values())
    assert by_tier == [("hot", "ready", True)] * 2 + [("warm", "ready", False)] * 2
    assert len(tiers) == 2 and all('"warm"' in body for _, body in tiers)
    assert len(ctl.promotion.samples[Source.cold]) == 4
    await ctl.actions.replica_api.aclose()


def test_without_fill_warm_nothing_is_started_for_the_warm_tier() -> None:
    ctl, backend = controller()
    ctl.deployments = {KEY: view(min_hot=1)}
    ctl.targets[(KEY, "1")] = TierCounts(hot=1, warm=2)
    ctl._carry_out()
    assert len(backend.launched) == 1  # the hot replica; no warm spare
    assert [r.then_tier for r in ctl.replicas.values()] == [None]


def test_the_standby_pool_grows_with_the_starts_it_serves_as_the_simulator_sizes_it() -> None:
    from ember.pools.autoscaler import StandbyPoolConfig
    from ember.pools.simulator import SharedStandby

    backend = FakeBackend()
    ctl = PoolsController(None, backend, standby_pool=1, standby_max=3)  # type: ignore[arg-type]
    ctl._keep_standby()
    assert len(backend.launched) == 1 and backend.launched == [None]  # the floor
    ctl.standby.spawn_s = [5.0]  # learned: a standby process takes 5 s to be ready
    sim = SharedStandby(StandbyPoolConfig(replenish_s=5.0, minimum=1))
    for _ in range(2):  # two starts within one refill time
        ctl.actions._standby_asked()
        sim.take(0.0)
    assert ctl.standby.size == 3 == sim.sizes[-1][1]  # one more than the most asked for
    ctl.actions._standby_asked()  # a third: the simulator would hold 4, the cap says 3
    assert ctl.standby.size == 3
    assert [e["size"] for e in ctl.events if e["event"] == "standby_pool"] == [2, 3]
    ctl._keep_standby()
    assert len(backend.launched) == 3
    # A fixed pool (no maximum above the floor) and a pool turned off never grow.
    for floor, most in ((1, None), (0, 4)):
        fixed = PoolsController(None, FakeBackend(), standby_pool=floor, standby_max=most)  # type: ignore[arg-type]
        for _ in range(5):
            fixed.actions._standby_asked()
        assert fixed.standby.size == floor


def test_standby_processes_reserve_memory_for_the_largest_version_that_fits() -> None:
    class NoVllm(FakeBackend):
        def standby_can_run(self, spec: VersionSpec) -> bool:
            return spec.engine != "vllm"

    backend = NoVllm()
    ctl = PoolsController(None, backend, standby_pool=1, standby_reserve_max=1 << 30)  # type: ignore[arg-type]
    ctl._keep_standby()
    assert backend.options[-1].reserve_bytes == 0  # nothing deployed yet
    small, large, llm = view(), view(), view()
    small.sizes = {"1": 90_000_000}
    large.sizes = {"1": 3 << 30}  # beyond the cap: it would hold 3 GiB per spare
    llm.specs = {"1": llm.specs["1"].model_copy(update={"engine": "vllm"})}
    llm.sizes = {"1": 500_000_000}  # a standby process cannot become its replica
    gone = view()
    gone.sizes = {"1": 95_000_000, "2": 700_000_000}  # "2" no longer served (no spec)
    ctl.deployments = {
        DeploymentKey(1, n): v for n, v in zip("abcd", (small, large, llm, gone), strict=True)
    }
    ctl.replicas.clear()
    ctl._keep_standby()
    huge = 2 * 1024 * 1024
    assert backend.options[-1].reserve_bytes == -(-95_000_000 // huge) * huge
