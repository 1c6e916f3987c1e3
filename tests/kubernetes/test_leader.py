"""Leader election over a Lease, and two pools controllers on one cluster: exactly one
acts, the other follows; when the leader leaves, the follower adopts its replicas."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import kmock
import pytest

from ember.api.app import prepare
from ember.config import Settings
from ember.pools.backends.kubernetes import KubernetesBackend
from ember.pools.controller import PoolsController
from ember.pools.demand import SharedDemand
from ember.pools.leader import LeaseElection
from tests.kubernetes.conftest import NAMESPACE, FakeCluster, api_client


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pair(url: str, clock: Clock) -> tuple[LeaseElection, LeaseElection]:
    def make(who: str) -> LeaseElection:
        return LeaseElection(api_client(url), NAMESPACE, "ember-pools", identity=who,
                             duration_s=15, clock=clock)  # fmt: skip

    return make("api-a"), make("api-b")


def test_one_holder_renews_and_a_candidate_takes_over_only_after_expiry(
    kube: tuple[str, kmock.KubernetesEmulator],
) -> None:
    clock = Clock()
    a, b = _pair(kube[0], clock)
    assert a.step() and not b.step()  # a creates the Lease; b sees a live holder
    clock.now += 10
    assert a.step() and not b.step()  # renewed: b saw the record change
    clock.now += 10  # a is gone (no renewal); b has seen the same record for 10 s only
    assert not a.is_leader  # a's renew deadline (2/3 of 15 s) passed: it stops acting
    assert not b.step()
    clock.now += 6  # 16 s unchanged on b's own clock > 15 s
    assert b.step() and b.is_leader
    assert not a.step()  # a comes back: b holds it now
    lease = b.api.read_namespaced_lease("ember-pools", NAMESPACE)
    assert lease.spec.holder_identity == "api-b" and lease.spec.lease_transitions == 1
    b.release()  # clean shutdown: a takes over at once, no expiry wait
    assert a.step()


def test_a_conflicting_write_loses(kube: tuple[str, kmock.KubernetesEmulator]) -> None:
    clock = Clock()
    a, _ = _pair(kube[0], clock)
    assert a.step()
    kube[1]["patch"][:1] << 409 << {"kind": "Status", "code": 409, "reason": "Conflict"}
    assert not a.step()  # someone else wrote the Lease between our read and our write
    assert not a.is_leader


@pytest.fixture
def registry(data_dir: Path) -> object:
    engine, _ = prepare(Settings(data_dir=data_dir))
    return engine


def test_exactly_one_controller_acts_and_a_new_leader_adopts_the_replicas(
    make_backend: Callable[..., KubernetesBackend],
    cluster: FakeCluster,
    kube: tuple[str, kmock.KubernetesEmulator],
    registry: object,
    redis_url: str,
) -> None:
    demand_key = f"ember:test:demand:{uuid.uuid4().hex}"

    def controller(who: str) -> PoolsController:
        backend = make_backend()
        lease = LeaseElection(api_client(kube[0]), NAMESPACE, "ember-pools", identity=who,
                              duration_s=3)  # fmt: skip
        c = PoolsController(registry, backend, standby_pool=2, tick_s=0.02,  # type: ignore[arg-type]
                            leader=lease)  # fmt: skip
        c.shared_demand = SharedDemand(redis_url, key=demand_key)
        return c

    async def until(check: Callable[[], bool], what: str) -> None:
        async with asyncio.timeout(10):
            while not check():  # noqa: ASYNC110 - polls the controllers' own state
                await asyncio.sleep(0.02)

    async def scenario() -> None:
        a = controller("api-a")
        a.start()
        await until(lambda: a.leading and len(a.replicas) == 2, "a to lead and launch")
        b = controller("api-b")
        b.start()
        standby = lambda c: sorted(  # noqa: E731
            r.handle.replica_id for r in c.replicas.values() if r.state == "standby"
        )
        await until(lambda: len(standby(a)) == 2, "a's standby pods ready")
        await until(lambda: standby(b) == standby(a), "b to observe a's replicas")
        assert not b.leading
        # What the follower's gateway counts reaches the leader's autoscaler input.
        b.record_demand((7, "elsewhere"), "3", 5.0, admitted=True)
        b.record_demand((7, "elsewhere"), "3", 2.0, admitted=False)
        a.record_demand((7, "elsewhere"), "3", 1.0, admitted=True)
        key = ((7, "elsewhere"), "3")
        await until(lambda: a.demand.get(key) == [8.0, 6.0], "b's demand summed into a's")
        assert not b.demand
        pods = sorted(p["metadata"]["name"] for p in cluster.pods())
        await a.stop()  # releases the Lease; the pods stay
        await until(lambda: b.leading, "b to take over")
        await until(lambda: len(standby(b)) == 2, "b's adopted replicas confirmed")
        assert sorted(p["metadata"]["name"] for p in cluster.pods()) == pods  # none restarted
        (deployment,) = cluster.deployments().values()
        assert deployment["spec"]["replicas"] == 2
        assert not any(e["event"] == "starting" for e in b.events)  # b launched nothing
        # b read the replicas' secret back from their Secret (it made none): every call of
        # either controller carried it, and the fake replicas refused none.
        secrets = {r.handle.secret for r in b.replicas.values()}
        assert len(secrets) == 1 and "" not in secrets
        assert secrets == {r.handle.secret for r in a.replicas.values()}
        assert secrets == {f.secret for f in cluster.replicas.values()}
        assert [f.rejected for f in cluster.replicas.values()] == [[], []]
        await b.stop()

    asyncio.run(scenario())
