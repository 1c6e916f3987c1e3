"""A request that waits for a replica is counted once in the autoscaler's demand: its
arrival when it starts waiting (so a warm replica is promoted for it), its admission when
a replica is ready, not its arrival a second time."""

from __future__ import annotations

import asyncio
import time

from ember.domain.spec import Priority, ReplicaState, VersionSpec
from ember.pools.backends.base import ReplicaHandle
from ember.pools.controller import PoolsController
from ember.pools.inventory import ManagedReplica
from ember.registry.schemas import PoolPolicy
from ember.serving.admission import Admission
from ember.serving.gateway import Gateway
from ember.serving.router import Route
from ember.serving.routing import DeploymentView
from tests.pools.test_controller_autoscale import FakeBackend

KEY = (1, "mlp")


def test_a_request_that_waited_for_a_replica_arrives_once() -> None:
    asyncio.run(_waited())


async def _waited() -> None:
    controller = PoolsController(None, FakeBackend(), standby_pool=0)  # type: ignore[arg-type]
    view = DeploymentView(
        1,
        "mlp",
        "mlp",
        {"1": 100},
        PoolPolicy(),
        {
            "1": VersionSpec(
                model="mlp", version="1", artifact_uri="file:///mlp", sha256="", engine="torch"
            )
        },
        [],
    )
    controller.deployments[KEY] = view
    url = "http://127.0.0.1:1/r"
    replica = ManagedReplica(ReplicaHandle("r", url), KEY, "mlp", "1", state="starting")
    controller.replicas["r"] = replica
    controller.publish()  # the control side publishes what is routable or on its way
    gateway = Gateway(controller, Admission(1e9, 1e9), 0.1)

    async def ready_soon() -> None:
        await asyncio.sleep(0.2)
        replica.state, replica.route = ReplicaState.ready, Route("r", url, "1")
        controller.publish()

    task = asyncio.create_task(ready_soon())
    routes, waited = await gateway._await_replica(KEY, "1", 1.0, time.monotonic() + 5.0)
    await task
    assert [r.replica_id for r in routes] == ["r"] and waited
    gateway.admit(view, "t", "1", routes, 1.0, Priority.online, 5.0, arrived=not waited)
    assert controller.demand[(KEY, "1")] == [1.0, 1.0]  # arrived once, admitted once

    # Nothing on its way: no wait, nothing reported yet; admission reports both.
    del controller.replicas["r"]
    controller.publish()
    routes, waited = await gateway._await_replica(KEY, "1", 1.0, time.monotonic() + 5.0)
    assert (routes, waited) == ((), False)
    assert controller.demand[(KEY, "1")] == [1.0, 1.0]
