"""Tenants as an admin sees them: the trusted flag and quota overrides (issue 20)."""

from __future__ import annotations

from tests.api.conftest import Api


def test_an_admin_marks_a_tenant_trusted_and_sets_its_quotas(api: Api) -> None:
    created = api.admin.post("/v1/tenants", json={"name": "acme", "quotas": {"replicas": 3}})
    assert created.status_code == 201, created.text
    assert created.json()["trusted"] is False
    assert created.json()["quotas"]["replicas"] == 3

    patched = api.admin.patch(
        "/v1/tenants/acme", json={"trusted": True, "quotas": {"gpus": 2, "batch_runs": 1}}
    )
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert body["trusted"] is True
    # quotas are replaced whole: what is left out takes the default again
    assert body["quotas"]["gpus"] == 2 and body["quotas"]["replicas"] is None

    read = api.admin.get("/v1/tenants/acme").json()
    assert read["trusted"] is True and read["quotas"]["batch_runs"] == 1
    # trusted alone leaves the quotas as they are
    api.admin.patch("/v1/tenants/acme", json={"trusted": False})
    assert api.admin.get("/v1/tenants/acme").json()["quotas"]["gpus"] == 2


def test_tenant_keys_cannot_read_or_change_tenants(api: Api) -> None:
    alice = api.tenant_client("alice")
    for response in (
        alice.get("/v1/tenants/alice"),
        alice.patch("/v1/tenants/alice", json={"trusted": True}),
        alice.patch("/v1/tenants/alice", json={"quotas": {"replicas": 1000}}),
    ):
        assert response.status_code == 403, response.text
        assert response.headers["content-type"].startswith("application/problem+json")
    assert api.admin.get("/v1/tenants/alice").json()["trusted"] is False


def test_bad_tenant_updates_are_problems(api: Api) -> None:
    api.admin.post("/v1/tenants", json={"name": "acme"})
    for body in ({"quotas": {"replicas": -1}}, {"quotas": {"unknown": 1}}, {"trusted": "yes"}):
        response = api.admin.patch("/v1/tenants/acme", json=body)
        assert response.status_code == 422, (body, response.text)
    assert api.admin.patch("/v1/tenants/nobody", json={"trusted": True}).status_code == 404
    assert api.admin.patch("/v1/tenants/Bad..Name", json={}).status_code == 422


def test_a_new_tenant_can_be_acted_for_at_once_though_it_was_refused_before(api: Api) -> None:
    """Acting for a tenant that does not exist yet is refused, and the refusal is cached;
    creating the tenant drops it, so the admin acts for it at once (not 5 s later)."""
    headers = {"X-Ember-Tenant": "later"}
    assert api.admin.get("/v1/deployments", headers=headers).status_code == 404
    assert api.admin.post("/v1/tenants", json={"name": "later"}).status_code == 201
    acting = api.admin.get("/v1/deployments", headers=headers)
    assert acting.status_code == 200, acting.text
