"""The one interface between control and serving: the controller publishes a routing
table of immutable per-(deployment, version) snapshots, the gateway reads it in O(1) and
counts in-flight units on its routes, which the controller reads back through the table."""

from __future__ import annotations

from ember.domain.spec import STANDBY_POOL, DeploymentKey, ReplicaState, Tier
from ember.pools.backends.base import ReplicaHandle
from ember.pools.controller import PoolsController
from ember.pools.inventory import ManagedReplica
from ember.serving.router import Route
from ember.serving.routing import Lane, RoutingTable
from tests.pools.test_controller_autoscale import FakeBackend

KEY = DeploymentKey(1, "mlp")


def _replica(rid: str, version: str, state: ReplicaState, tier: Tier = Tier.hot) -> ManagedReplica:
    replica = ManagedReplica(ReplicaHandle(rid, f"http://r/{rid}"), KEY, "mlp", version,
                             state=state, tier=tier)  # fmt: skip
    if state is ReplicaState.ready:
        replica.route = Route(rid, replica.handle.url, version)
    return replica


def test_a_published_lane_is_a_snapshot_swapped_whole() -> None:
    table = RoutingTable()
    a, b = Route("a", "http://a", "1"), Route("b", "http://b", "1")
    table.publish({(KEY, "1"): Lane((a, b))})
    before = table.routes((1, "mlp"), "1")  # a plain tuple key finds it too
    assert before == (a, b) and table.routes(KEY, "2") == () and not table.lane(KEY, "2").coming
    table.publish({(KEY, "1"): Lane((b,))}, tracked=[a])  # a drains: not routed, still counted
    assert before == (a, b) and table.routes(KEY, "1") == (b,)  # the old snapshot is intact
    a.inflight_units = 3.0
    assert table.inflight_units("a") == 3.0 and table.inflight_units("gone") == 0.0


def test_the_controller_publishes_ready_hot_replicas_and_what_is_on_its_way() -> None:
    ctl = PoolsController(None, FakeBackend(), standby_pool=0)  # type: ignore[arg-type]
    for replica in (
        _replica("hot", "1", ReplicaState.ready),
        _replica("warm", "1", ReplicaState.ready, Tier.warm),
        _replica("new", "2", ReplicaState.starting),
        _replica("going", "1", ReplicaState.draining),
    ):
        ctl.replicas[replica.handle.replica_id] = replica
    spare = ManagedReplica(ReplicaHandle("spare", "http://r/spare"), STANDBY_POOL, "", "",
                           state=ReplicaState.standby, tier=Tier.standby)  # fmt: skip
    ctl.replicas["spare"] = spare
    ctl.publish()
    assert [r.replica_id for r in ctl.table.routes(KEY, "1")] == ["hot"]
    assert ctl.table.lane(KEY, "1").coming  # the warm one can be promoted
    assert ctl.table.routes(KEY, "2") == () and ctl.wake(KEY, "2")  # starting: on its way
    ctl.replicas["going"].route = Route("going", "http://r/going", "1", inflight_units=2.0)
    ctl.publish()
    assert ctl.table.inflight_units("going") == 2.0  # a draining replica's load stays readable
    del ctl.replicas["new"]
    ctl.publish()
    assert not ctl.wake(KEY, "2")  # nothing on its way, no scale-to-zero deployment to wake
