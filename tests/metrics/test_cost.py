"""Cost per success (issue 23 §2): two real API processes on one Redis give the same
figure, and it is the hand count — replica-seconds from the replica inventories of both,
over the 2xx answers sent through both."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ember.pools.costs import FLUSH_S
from tests import services
from tests.metrics.conftest import ApiProc, Deployed, X


def _inventory_s(*apis: ApiProc) -> tuple[float, int]:
    """Seconds the replicas of ``mlp`` have lived, summed over both API processes' own
    inventories, and how many replicas that is."""
    replicas = [r for api in apis for r in api.live.replicas("mlp")]
    assert replicas and all(r["version"] == "1" for r in replicas), replicas
    return sum(float(r["uptime_s"]) for r in replicas), len(replicas)


def _lifetime(cost: dict[str, Any]) -> dict[str, Any]:
    return dict(cost["versions"]["1"]["breakdown"]["lifetime"])


def test_the_same_figure_from_both_api_processes_and_it_is_the_hand_count(
    deployed: Deployed,
) -> None:
    a, b = deployed.a, deployed.b
    before = _lifetime(a.cost("mlp"))["successes"]
    sent = 0
    for i in range(14):
        api = (a, b)[i % 2]
        answer = api.client.post("/v1/models/mlp:predict", json={"instances": [X]})
        assert answer.status_code == 200, answer.text
        sent += 1
    for api in (a, b):  # refused input is no success
        bad = api.client.post("/v1/models/mlp:predict", json={"instances": [[1.0]]})
        assert bad.status_code == 422, bad.text
    total = before + sent
    services.wait_until(
        lambda: (
            _lifetime(a.cost("mlp"))["successes"] == total
            and _lifetime(b.cost("mlp"))["successes"] == total
        ),
        30,
        "both processes' successes counted in Redis",
    )

    checked = False
    for _ in range(30):
        lived_before, n = _inventory_s(a, b)
        first, theirs, again = a.cost("mlp"), b.cost("mlp"), a.cost("mlp")
        lived_after, _ = _inventory_s(a, b)
        if first != again:  # a flush fell between the reads: b's may be either; again
            continue
        assert theirs == first  # read between two identical answers: the same counts
        version = first["versions"]["1"]
        life = version["breakdown"]["lifetime"]
        seconds = sum(life["replica_seconds"].values())
        assert life["successes"] == total
        assert set(life["replica_seconds"]) == {"hot", "standby_share"}
        assert life["replica_seconds"]["standby_share"] == 0  # no standby process here
        assert version["lifetime"] == pytest.approx(seconds / total, rel=1e-9)
        for window in ("1h", "24h"):  # everything happened within the hour
            assert version["window"][window] == pytest.approx(version["lifetime"], rel=1e-9)
        assert version["window"]["5m"] is not None
        # counted once: never more than the replicas lived (an API process counting the
        # other's replicas, or each adding all, would be N x this) ...
        assert seconds <= lived_after + 0.001 * n
        # ... and all of it, up to what the controllers observed since their last flush
        if seconds >= lived_before - n * 2 * FLUSH_S:
            checked = True
            break
    assert checked, (first, lived_before, lived_after)


def test_the_cost_route_is_tenant_scoped_and_checks_its_input(deployed: Deployed) -> None:
    a = deployed.a
    a.client.post("/v1/tenants", json={"name": "other"})
    key = a.client.post("/v1/keys", json={"name": "k", "tenant": "other"})
    assert key.status_code == 201, key.text
    other = httpx.Client(
        base_url=a.live.url, headers={"Authorization": f"Bearer {key.json()['key']}"}
    )
    with other:
        theirs = other.get("/v1/deployments/mlp/cost")
        assert theirs.status_code == 404, theirs.text  # not its deployment: not there
        assert theirs.headers["content-type"].startswith("application/problem+json")
        assert "replica" not in theirs.text
        metrics = other.get("/metrics")  # its /metrics holds none of another tenant's cost
        assert metrics.status_code == 200
        assert 'deployment="mlp"' not in metrics.text
    anonymous = httpx.get(f"{a.live.url}/v1/deployments/mlp/cost")
    assert anonymous.status_code == 401
    for bad in ("NOT_A_NAME", "x" * 300):
        answer = a.client.get(f"/v1/deployments/{bad}/cost")
        assert answer.status_code == 422, answer.text
        assert answer.headers["content-type"].startswith("application/problem+json")
    missing = a.client.get("/v1/deployments/nothing-here/cost")
    assert missing.status_code == 404
    assert missing.headers["content-type"].startswith("application/problem+json")
