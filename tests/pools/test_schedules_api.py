"""Deployment schedules and the autoscaler route over the real API (registry, uvicorn on
loopback): a schedule round-trips through PATCH, a hostile one is a precise 422 problem,
another tenant cannot see the autoscaler of a deployment that is not its own."""

from __future__ import annotations

from pathlib import Path

from tests.api.conftest import Api, api, api_settings, registry_url, store_dir  # noqa: F401
from tests.api.test_deployments import deploy
from tests.api.test_models import problem

EVENT = {"cron": "30 8 * * 1-5", "timezone": "Europe/Paris", "duration_s": 7200, "min_hot": 3}


def test_schedules_round_trip_and_are_validated(api: Api, store_dir: Path) -> None:  # noqa: F811
    deploy(api, store_dir, ("1",))
    d = api.admin.patch("/v1/deployments/minilm", json={"max_replicas": 6, "schedules": [EVENT]})
    assert d.status_code == 200, d.text
    assert d.json()["schedules"] == [EVENT | {"min_warm": 0}]
    assert api.admin.get("/v1/deployments/minilm").json()["schedules"][0]["min_hot"] == 3
    for bad in (
        {"cron": "every morning"},
        {"cron": "30 8 * * 1-5", "timezone": "../../etc/passwd"},
        {"cron": "30 8 * * 1-5", "min_hot": 5, "min_warm": 5},  # over max_replicas (6)
        {"cron": "30 8 * * 1-5", "surprise": 1},
    ):
        problem(api.admin.patch("/v1/deployments/minilm", json={"schedules": [bad]}), 422,
                "invalid-input")  # fmt: skip
    # Nothing stored changed.
    assert api.admin.get("/v1/deployments/minilm").json()["schedules"] == [EVENT | {"min_warm": 0}]


def test_the_autoscaler_route_is_the_owners_only(api: Api, store_dir: Path) -> None:  # noqa: F811
    deploy(api, store_dir, ("1",))
    # This API runs no pools controller: the owner is told so (503), not given a 500 ...
    problem(api.admin.get("/v1/deployments/minilm/autoscaler"), 503, "not-ready")
    # ... another tenant does not learn the deployment exists.
    other = api.tenant_client("bob")
    problem(other.get("/v1/deployments/minilm/autoscaler"), 404, "not-found")
    problem(api.admin.get("/v1/deployments/nope/autoscaler"), 404, "not-found")
