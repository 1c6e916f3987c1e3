"""Deployments: canary, promote, rollback, policy — over the real API."""

from __future__ import annotations

from pathlib import Path

from tests.api.conftest import Api
from tests.api.test_models import problem, register


def deploy(api: Api, store_dir: Path, versions: tuple[str, ...] = ("1", "2", "3")) -> None:
    for v in versions:
        register(api, store_dir, "minilm", v)
    created = api.admin.post("/v1/deployments", json={"model": "minilm", "version": "1"})
    assert created.status_code == 201, created.text


def test_create_defaults_to_the_model_name_and_safe_policy(api: Api, store_dir: Path) -> None:
    deploy(api, store_dir)
    d = api.admin.get("/v1/deployments/minilm").json()
    assert d["traffic"] == {"1": 100} and d["aliases"] == {"production": "1"}
    assert d["min_hot"] == 1 and d["scale_to_zero"] is False
    assert {"max_replicas", "target_utilization", "max_batch_size", "max_queue_delay_ms",
            "timeout_ms", "priority"} <= set(d)  # fmt: skip
    problem(api.admin.post("/v1/deployments", json={"model": "minilm", "version": "1"}), 409,
            "conflict")  # fmt: skip


def test_canary_promote_and_rollback(api: Api, store_dir: Path) -> None:
    deploy(api, store_dir)
    d = api.admin.post("/v1/deployments/minilm:canary", json={"version": "2", "weight": 20}).json()
    assert d["traffic"] == {"1": 80, "2": 20} and d["aliases"]["canary"] == "2"
    d = api.admin.post("/v1/deployments/minilm:rollback").json()  # drops the canary
    assert d["traffic"] == {"1": 100} and "canary" not in d["aliases"]
    api.admin.post("/v1/deployments/minilm:canary", json={"version": "2"})
    d = api.admin.post("/v1/deployments/minilm:promote").json()
    assert d["traffic"] == {"2": 100} and d["aliases"] == {"production": "2"}
    d = api.admin.post("/v1/deployments/minilm:promote", json={"version": "3"}).json()
    assert d["aliases"] == {"production": "3"}
    assert api.admin.post("/v1/deployments/minilm:rollback").json()["aliases"]["production"] == "2"
    assert api.admin.post("/v1/deployments/minilm:rollback").json()["aliases"]["production"] == "1"
    problem(api.admin.post("/v1/deployments/minilm:rollback"), 409, "conflict")
    history = api.admin.get("/v1/deployments/minilm/revisions").json()
    assert [h["revision"] for h in history] == list(range(1, len(history) + 1))
    assert history[0]["reason"] == "create"


def test_only_ready_versions_serve(api: Api, store_dir: Path) -> None:
    deploy(api, store_dir, ("1",))
    problem(
        api.admin.post("/v1/deployments/minilm:canary", json={"version": "9"}), 404, "not-found"
    )
    problem(api.admin.post("/v1/deployments", json={"model": "nope", "version": "1"}), 404,
            "not-found")  # fmt: skip
    problem(api.admin.post("/v1/deployments/minilm:promote"), 409, "conflict")  # no canary


def test_policy_changes_are_validated(api: Api, store_dir: Path) -> None:
    deploy(api, store_dir, ("1",))
    d = api.admin.patch("/v1/deployments/minilm", json={"min_hot": 2, "max_batch_size": 64}).json()
    assert d["min_hot"] == 2 and d["max_batch_size"] == 64 and d["max_replicas"] == 4
    body = problem(api.admin.patch("/v1/deployments/minilm", json={"min_hot": 0}), 422,
                   "invalid-input")  # fmt: skip
    assert "scale_to_zero" in str(body["detail"])
    d = api.admin.patch("/v1/deployments/minilm", json={"min_hot": 0, "scale_to_zero": True}).json()
    assert d["min_hot"] == 0
    problem(api.admin.patch("/v1/deployments/minilm", json={"min_hot": 9}), 422, "invalid-input")
    problem(api.admin.patch("/v1/deployments/minilm", json={"target_utilization": 1.5}), 422,
            "invalid-input")  # fmt: skip
    problem(api.admin.patch("/v1/deployments/minilm", json={"max_replicas": None}), 422,
            "invalid-input")  # fmt: skip
    problem(api.admin.patch("/v1/deployments/minilm", json={"fallback": ["7"]}), 404, "not-found")
    problem(api.admin.post("/v1/deployments", json={"model": "minilm", "version": "1",
                                                     "name": "x", "min_hot": 0}),
            422, "invalid-input")  # fmt: skip


def test_models_and_versions_in_use_cannot_be_deleted(api: Api, store_dir: Path) -> None:
    deploy(api, store_dir, ("1", "2"))
    body = problem(api.admin.delete("/v1/models/minilm"), 409, "conflict")
    assert body["deployments"] == ["minilm"]
    problem(api.admin.delete("/v1/models/minilm/versions/1"), 409, "conflict")
    assert api.admin.delete("/v1/models/minilm/versions/2").status_code == 204
    assert api.admin.delete("/v1/deployments/minilm").status_code == 204
    assert api.admin.delete("/v1/models/minilm").status_code == 204
    problem(api.admin.get("/v1/models/minilm/versions/1"), 404, "not-found")


def test_other_tenants_cannot_see_or_touch_deployments(api: Api, store_dir: Path) -> None:
    deploy(api, store_dir, ("1",))
    bob = api.tenant_client("bob")
    problem(bob.get("/v1/deployments/minilm"), 404, "not-found")
    problem(bob.post("/v1/deployments/minilm:rollback"), 404, "not-found")
    problem(bob.post("/v1/deployments", json={"model": "minilm", "version": "1"}), 404, "not-found")
    assert bob.get("/v1/deployments").json()["items"] == []
