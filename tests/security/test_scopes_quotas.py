"""Scopes, quotas and the rate limit (issue 20 §5, §6), against a real API.

Admin-only stays admin-only (keys, cost models, ``:batch-lane``); worker keys act for any
tenant on the data plane and nothing else; a tenant's deployments, jobs and batch runs
stay within its quotas until an admin raises them; the control plane's per-key rate
limit is shared by two API processes through one Redis; key look-ups run off the event
loop and bad keys are answered from a cache, not the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import event

from ember.api.app import create_app
from ember.batch.beat import Beat
from ember.config import Settings
from ember.registry.db import make_engine
from ember.registry.tables import Tenant
from ember.work.queue import make_celery
from tests import services
from tests.api import conftest as api_fixtures
from tests.api.conftest import ADMIN_KEY, MLP, Api
from tests.artifacts import write_valid

PROBLEM = "https://ember.dev/problems/"
# tests/api's fixtures: a real API on SQLite (and PostgreSQL with -m postgres)
registry_url = api_fixtures.registry_url
store_dir = api_fixtures.store_dir
api_settings = api_fixtures.api_settings
api = api_fixtures.api


def problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert body["type"] == PROBLEM + code, body
    return body


def as_tenant(api: Api, tenant: str) -> httpx.Client:
    """The admin acting for ``tenant`` (registers its versions anywhere in the store)."""
    return httpx.Client(
        base_url=api.url,
        headers={"Authorization": f"Bearer {ADMIN_KEY}", "X-Ember-Tenant": tenant},
        timeout=30,
    )


def new_key(api: Api, tenant: str, scope: str = "tenant") -> dict[str, Any]:
    api.admin.post("/v1/tenants", json={"name": tenant})
    created = api.admin.post("/v1/keys", json={"name": scope, "tenant": tenant, "scope": scope})
    assert created.status_code == 201, created.text
    return dict(created.json())


def register(api: Api, store: Path, tenant: str, model: str = "clf", version: str = "1") -> None:
    """A ready version ``model:version`` of ``tenant`` (made if need be)."""
    api.admin.post("/v1/tenants", json={"name": tenant})
    with as_tenant(api, tenant) as admin:
        admin.post("/v1/models", json={"name": model})
        path = write_valid(store / tenant / model / version / "model.safetensors")
        body = {"version": version, "artifact_uri": path.as_uri(), "engine": "torch",
                "engine_config": MLP}  # fmt: skip
        created = admin.post(f"/v1/models/{model}/versions", json=body)
        assert created.status_code == 201, created.text


def set_quotas(api: Api, tenant: str, **quotas: Any) -> None:
    patched = api.admin.patch(f"/v1/tenants/{tenant}", json={"quotas": quotas})
    assert patched.status_code == 200, patched.text


@contextlib.contextmanager
def serve(settings: Settings, engine: Any = None) -> Iterator[str]:
    with services.serve_app(create_app(settings, engine)) as url:
        yield url


# --- scopes -----------------------------------------------------------------------------


def test_a_tenant_key_neither_sees_nor_revokes_admin_or_worker_keys(api: Api) -> None:
    """The default tenant's tenant key used to list the admin key and revoke it (and the
    worker's: every async job stopped)."""
    mine = new_key(api, "default")
    worker = new_key(api, "default", "worker")
    admin_ids = [k["id"] for k in api.admin.get("/v1/keys").json()["items"]
                 if k["scope"] == "admin"]  # fmt: skip
    assert admin_ids
    tenant = api.client(mine["key"])
    listed = tenant.get("/v1/keys").json()["items"]
    assert {k["scope"] for k in listed} == {"tenant"}, listed
    assert mine["id"] in [k["id"] for k in listed]
    for key_id in [*admin_ids, worker["id"]]:
        problem(tenant.delete(f"/v1/keys/{key_id}"), 404, "not-found")
    assert api.admin.get("/v1/whoami").json()["scope"] == "admin"  # still valid
    # another tenant's tenant key: absent too; its own: revocable
    other = new_key(api, "bob")
    problem(tenant.delete(f"/v1/keys/{other['id']}"), 404, "not-found")
    spare = tenant.post("/v1/keys", json={"name": "spare"}).json()
    assert tenant.delete(f"/v1/keys/{spare['id']}").json()["revoked_at"] is not None
    # only admins make admin or worker keys
    for scope in ("admin", "worker"):
        problem(tenant.post("/v1/keys", json={"name": "x", "scope": scope}), 403, "forbidden")


def test_a_tenant_key_cannot_write_a_cost_model_or_ask_for_the_batch_lane(
    api: Api, store_dir: Path
) -> None:
    register(api, store_dir, "alice")
    alice = api.client(new_key(api, "alice")["key"])
    zero = {"alpha": 0.0, "beta": 0.0, "gamma": 0.0, "capacity_units_per_s": 1e9}
    path = "/v1/models/clf/versions/1/cost-models/cpu-x"
    problem(alice.put(path, json=zero), 403, "forbidden")
    version = alice.get("/v1/models/clf/versions/1").json()
    assert version["cost_models"] == {}
    problem(alice.post("/v1/models/clf/versions/1:batch-lane", json={"sent": 10**9}), 403,
            "forbidden")  # fmt: skip
    # the admin (acting for alice, as `ember calibrate --tenant alice` does) may
    with as_tenant(api, "alice") as admin:
        stored = admin.put(path, json={"alpha": 1.0, "beta": 0.0, "gamma": 0.001,
                                       "capacity_units_per_s": 1000.0})  # fmt: skip
        assert stored.status_code == 200, stored.text
    # a worker key gets past the scope check (this API runs no pools: 503, not 403)
    worker = httpx.Client(
        base_url=api.url,
        headers={"Authorization": f"Bearer {new_key(api, 'default', 'worker')['key']}",
                 "X-Ember-Tenant": "alice"},
        timeout=30,
    )  # fmt: skip
    with worker:
        problem(worker.post("/v1/models/clf/versions/1:batch-lane", json={"sent": 1}), 503,
                "not-ready")  # fmt: skip
        problem(worker.put(path, json=zero), 403, "forbidden")


def test_a_worker_key_acts_for_any_tenant_on_the_data_plane_and_nothing_else(
    api_settings: Settings, store_dir: Path
) -> None:
    settings = api_settings.model_copy(
        update={"pools_enabled": True, "standby_replicas": 0, "warm_set_bytes": 0}
    )
    with serve(settings) as url:
        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        api = Api(url, admin, settings)
        register(api, store_dir, "alice")
        alice = api.client(new_key(api, "alice")["key"])
        asleep = {"model": "clf", "version": "1", "min_hot": 0, "scale_to_zero": True}
        deployed = alice.post("/v1/deployments", json=asleep)
        assert deployed.status_code == 201, deployed.text
        worker_key = new_key(api, "default", "worker")["key"]

        def worker(tenant: str | None) -> httpx.Client:
            headers = {"Authorization": f"Bearer {worker_key}"}
            if tenant:
                headers["X-Ember-Tenant"] = tenant
            return httpx.Client(base_url=url, headers=headers, timeout=30)

        # the data plane, as alice (a scale-to-zero deployment: no replica is started)
        with worker("alice") as as_alice:
            metadata = as_alice.get("/v2/models/clf")
            assert metadata.status_code == 200, metadata.text
            assert metadata.json()["name"] == "clf"
            # nothing on the control plane, for alice or for itself
            for method, path, body in [
                ("POST", "/v1/keys", {"name": "mine", "scope": "admin"}),
                ("POST", "/v1/keys", {"name": "mine"}),
                ("GET", "/v1/keys", None),
                ("POST", "/v1/deployments", {"model": "clf", "version": "1", "name": "x"}),
                ("PATCH", "/v1/deployments/clf", {"max_replicas": 1000}),
                ("GET", "/v1/models", None),
                ("POST", "/v1/tenants", {"name": "eve"}),
                ("POST", "/v1/jobs", {"model": "clf", "inputs": {"instances": [[1.0]]}}),
                ("GET", "/v1/deployments/clf/replicas", None),
            ]:
                answer = as_alice.request(method, path, json=body)
                problem(answer, 403, "forbidden")
        with worker(None) as itself:
            problem(itself.get("/v1/keys"), 403, "forbidden")
            problem(itself.get("/v2/models/clf"), 404, "not-found")  # not the default's
        # a tenant key still cannot act for another tenant
        problem(alice.get("/v2/models/clf", headers={"X-Ember-Tenant": "default"}), 403,
                "forbidden")  # fmt: skip
        api.admin.close()


def test_ember_up_mints_its_worker_a_worker_key_not_an_admin_key(settings: Settings) -> None:
    from ember.api.app import prepare
    from ember.jobs.worker import mint_worker_key
    from ember.registry.db import session_scope
    from ember.registry.tables import KeyScope
    from ember.registry.tenants import authenticate

    engine, _ = prepare(settings)
    key = mint_worker_key(engine)
    with session_scope(engine) as session:
        session.add(Tenant(name="alice"))
    with session_scope(engine) as session:
        assert authenticate(session, key).scope is KeyScope.worker
        assert authenticate(session, key, "alice").tenant == "alice"  # acts for a tenant
    engine.dispose()


# --- quotas -----------------------------------------------------------------------------


def test_min_hot_1000_is_refused_naming_the_quota_until_an_admin_raises_it(
    api: Api, store_dir: Path
) -> None:
    register(api, store_dir, "t1")
    t1 = api.client(new_key(api, "t1")["key"])
    huge = {"model": "clf", "version": "1", "min_hot": 1000, "max_replicas": 1000}
    body = problem(t1.post("/v1/deployments", json=huge), 403, "quota-exceeded")
    assert body["quota"] == "replicas"
    assert body["detail"] == (
        "quota replicas exceeded: deployments would need 1000 replicas, tenant 't1' may hold 32"
    )
    assert t1.get("/v1/deployments").json()["items"] == []  # nothing was stored
    # GPUs: 9 replicas of one GPU each, over the default 8
    gpus = {"model": "clf", "version": "1", "max_replicas": 9,
            "placement": {"accelerator": "nvidia-l4", "gpus": 1}}  # fmt: skip
    assert problem(t1.post("/v1/deployments", json=gpus), 403, "quota-exceeded")["quota"] == "gpus"
    # a deployment that fits, then a change that would not
    assert t1.post("/v1/deployments", json={"model": "clf", "version": "1"}).status_code == 201
    grown = t1.patch("/v1/deployments/clf", json={"max_replicas": 40})
    assert problem(grown, 403, "quota-exceeded")["quota"] == "replicas"
    assert t1.get("/v1/deployments/clf").json()["max_replicas"] == 4
    # the sum over the tenant's deployments counts: 8 more of 4 replicas x 2 cores = 64
    for i in range(7):
        created = t1.post("/v1/deployments", json={"model": "clf", "version": "1",
                                                    "name": f"d{i}"})  # fmt: skip
        assert created.status_code == 201, created.text
    ninth = t1.post("/v1/deployments", json={"model": "clf", "version": "1", "name": "d9"})
    assert problem(ninth, 403, "quota-exceeded")["quota"] == "replicas"  # 36 > 32
    # the admin raises t1's quotas: the same requests pass
    set_quotas(api, "t1", replicas=2000, cpu_cores=4000, memory_gib=16000)
    assert t1.post("/v1/deployments", json={**huge, "name": "huge"}).status_code == 201
    assert t1.patch("/v1/deployments/clf", json={"max_replicas": 40}).status_code == 200
    # another tenant's quota is its own
    register(api, store_dir, "t2")
    t2 = api.client(new_key(api, "t2")["key"])
    problem(t2.post("/v1/deployments", json=huge), 403, "quota-exceeded")


def test_a_canary_and_a_fallback_version_count_against_the_replicas_quota(
    api: Api, store_dir: Path
) -> None:
    register(api, store_dir, "t1")
    register(api, store_dir, "t1", version="2")
    t1 = api.client(new_key(api, "t1")["key"])
    set_quotas(api, "t1", replicas=4)
    assert t1.post("/v1/deployments", json={"model": "clf", "version": "1"}).status_code == 201
    # production's max_replicas (4) + the canary's share of the floor (at least one)
    over = problem(t1.post("/v1/deployments/clf:canary", json={"version": "2", "weight": 20}),
                   403, "quota-exceeded")  # fmt: skip
    assert over["quota"] == "replicas" and "would need 5 replicas" in over["detail"], over
    assert t1.get("/v1/deployments/clf").json()["traffic"] == {"1": 100}
    # a fallback version: one replica more
    fallback = t1.patch("/v1/deployments/clf", json={"fallback": ["2"]})
    assert problem(fallback, 403, "quota-exceeded")["quota"] == "replicas"
    set_quotas(api, "t1", replicas=5)
    canary = t1.post("/v1/deployments/clf:canary", json={"version": "2", "weight": 20})
    assert canary.status_code == 200, canary.text


def test_a_deployments_worst_case_is_what_the_pools_controller_may_give_it() -> None:
    from ember.registry.quotas import worst_replicas
    from ember.registry.schemas import PoolPolicy

    policy = PoolPolicy(min_hot=5, max_replicas=8)
    assert worst_replicas(policy, {"1": 100, "2": 0}, "1", []) == 8  # weight 0: none
    assert worst_replicas(policy, {"1": 50, "2": 50}, "1", []) == 8 + 3  # ceil(5 x 50 %)
    assert worst_replicas(policy, {"1": 50, "2": 50}, "1", ["2"]) == 11  # routed already
    # scale to zero: a canary still gets one (a request wakes it); a fallback one, once
    zero = PoolPolicy(min_hot=0, scale_to_zero=True, max_replicas=3)
    assert zero.hot_floor == 0 and policy.hot_floor == 5
    assert worst_replicas(zero, {"1": 90, "2": 10}, "1", ["3", "3"]) == 3 + 1 + 1


@pytest.fixture
def queued(api_settings: Settings, redis_url: str) -> Iterator[Api]:
    """An API with a Redis for job and shard messages (no worker: everything stays queued)."""
    settings = api_settings.model_copy(update={"redis_url": redis_url})
    with serve(settings) as url, httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
    ) as admin:  # fmt: skip
        yield Api(url, admin, settings)


def test_queued_jobs_and_stored_job_bytes_quotas(queued: Api, store_dir: Path) -> None:
    api = queued
    register(api, store_dir, "t1")
    t1 = api.client(new_key(api, "t1")["key"])
    assert t1.post("/v1/deployments", json={"model": "clf", "version": "1"}).status_code == 201
    job = {"model": "clf", "inputs": {"instances": [[0.5] * 8] * 4}}  # 137 bytes of JSON
    set_quotas(api, "t1", job_bytes=100)
    over = problem(t1.post("/v1/jobs", json=job), 403, "quota-exceeded")
    assert over["quota"] == "job_bytes" and "t1" in over["detail"], over
    set_quotas(api, "t1", job_bytes=200)
    assert t1.post("/v1/jobs", json=job).status_code == 202
    # the first job's inputs count: a second does not fit in 200 bytes
    assert problem(t1.post("/v1/jobs", json=job), 403, "quota-exceeded")["quota"] == "job_bytes"
    set_quotas(api, "t1", queued_jobs=2)  # job_bytes back to its default
    assert t1.post("/v1/jobs", json=job).status_code == 202
    third = t1.post("/v1/jobs", json=job)
    body = problem(third, 429, "back-pressure")
    assert body["quota"] == "queued_jobs" and int(third.headers["Retry-After"]) >= 1
    assert body["detail"].startswith("quota queued_jobs exceeded: tenant 't1' has 2")


def test_batch_runs_in_flight_quota_on_start_and_on_a_scheduled_fire(
    queued: Api, store_dir: Path
) -> None:
    api = queued
    register(api, store_dir, "t1")
    data = store_dir / "batch" / "t1" / "in.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text('{"id": 1, "features": [0.5]}\n')
    spec = {"model": "clf", "input_uri": data.as_uri(),
            "output_uri": (store_dir / "batch" / "t1" / "out").as_uri()}  # fmt: skip
    with as_tenant(api, "t1") as t1:
        assert t1.post("/v1/deployments", json={"model": "clf", "version": "1"}).status_code == 201
        set_quotas(api, "t1", batch_runs=1)
        first = t1.post("/v1/batch/runs", json={"spec": spec})
        assert first.status_code == 202, first.text
        assert first.json()["status"] == "running"  # no worker: it stays in flight
        second = t1.post("/v1/batch/runs", json={"spec": spec})
        body = problem(second, 429, "back-pressure")
        assert body["quota"] == "batch_runs" and "Retry-After" in second.headers
        # a schedule firing over the quota: recorded as refused, beat goes on
        schedule = t1.post("/v1/batch/schedules",
                           json={**spec, "name": "nightly", "cron": "* * * * *"})  # fmt: skip
        assert schedule.status_code == 201, schedule.text
        from datetime import datetime

        due = datetime.fromisoformat(schedule.json()["next_fire_at"]) + timedelta(seconds=1)
        beat = Beat(api.settings, make_engine(api.settings.registry_url),
                    make_celery(api.settings))  # fmt: skip
        fired = beat.tick(due)
        assert [r.status for r in fired] == ["failed"]
        runs = t1.get("/v1/batch/runs", params={"schedule": "nightly"}).json()["items"]
        assert [r["status"] for r in runs] == ["failed"]
        assert runs[0]["error"].startswith("quota batch_runs exceeded: tenant 't1' has 1")
        set_quotas(api, "t1", batch_runs=2)
        assert t1.post("/v1/batch/runs", json={"spec": spec}).status_code == 202


# --- the rate limit ---------------------------------------------------------------------


def test_the_control_plane_rate_limit_is_shared_by_two_api_processes(
    api_settings: Settings, redis_url: str
) -> None:
    """One key, two API processes on one Redis: a burst of 4 at 0.01 request/s is spent
    across both, and the fifth request, to either, is 429 with ``Retry-After``."""
    settings = api_settings.model_copy(
        update={"redis_url": redis_url, "quota_requests_per_s": 0.01, "quota_request_burst": 4}
    )
    with serve(settings) as one, serve(settings) as two:
        admin = httpx.Client(base_url=one, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        api = Api(one, admin, settings)
        key = new_key(api, "t1")["key"]
        clients = [httpx.Client(base_url=u, headers={"Authorization": f"Bearer {key}"})
                   for u in (one, two)]  # fmt: skip
        statuses = [clients[i % 2].get("/v1/models").status_code for i in range(4)]
        assert statuses == [200] * 4
        for client in clients:
            refused = client.get("/v1/models")
            body = problem(refused, 429, "rate-limited")
            assert body["quota"] == "requests_per_s"
            assert 1 <= int(refused.headers["Retry-After"]) <= 100
        # the data plane is not held to it (its admission budget is); nor is the admin
        assert (
            clients[0].post("/v1/models/clf:predict", json={"instances": [[1.0]]}).status_code
            != 429
        )
        assert all(admin.get("/v1/models").status_code == 200 for _ in range(10))
        # another key of the same tenant has its own allowance
        other = httpx.Client(
            base_url=two, headers={"Authorization": f"Bearer {new_key(api, 't1')['key']}"}
        )
        assert other.get("/v1/models").status_code == 200
        # an admin override of the tenant's rate applies (the burst window stays 400 s)
        set_quotas(api, "t1", requests_per_s=1000.0)
        assert clients[0].get("/v1/models").status_code == 200
        for client in [*clients, other, admin]:
            client.close()


# --- key look-ups -----------------------------------------------------------------------


def test_bad_keys_are_answered_from_a_cache_and_look_ups_leave_the_event_loop(
    api_settings: Settings,
) -> None:
    engine = make_engine(api_settings.registry_url)
    lookups: list[bool] = []  # per api_keys query: whether it ran on an event loop

    def on_query(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "api_keys" in statement and "key_hash" in statement and "SELECT" in statement:
            try:
                asyncio.get_running_loop()
                lookups.append(True)
            except RuntimeError:
                lookups.append(False)

    event.listen(engine, "before_cursor_execute", on_query)
    app = create_app(api_settings, engine)
    app.state.principals.refusal_ttl_s = 3600.0  # this test counts, it does not time
    with services.serve_app(app) as url:
        start = len(lookups)  # the start-up's own (bootstrap) are not requests
        bad = httpx.Client(base_url=url, headers={"Authorization": "Bearer ek_not-a-key"})
        for _ in range(30):
            problem(bad.get("/v1/models"), 401, "unauthenticated")
        flood = lookups[start:]
        assert len(flood) == 1, f"{len(flood)} database look-ups for 30 requests of one bad key"
        # many at once with another bad key: one look-up for it (the others wait for it)
        other = httpx.Client(base_url=url, headers={"Authorization": "Bearer ek_another-bad"})
        threads = [threading.Thread(target=lambda: other.get("/v1/deployments")) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(lookups[start:]) == 2
        # a revoked key drops at once in this process, and is then refused from the cache
        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        key = admin.post("/v1/keys", json={"name": "soon-revoked"}).json()
        mine = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key['key']}"})
        assert mine.get("/v1/models").status_code == 200
        assert admin.delete(f"/v1/keys/{key['id']}").status_code == 200
        problem(mine.get("/v1/models"), 401, "unauthenticated")
        counted = len(lookups)
        for _ in range(20):
            problem(mine.get("/v1/models"), 401, "unauthenticated")
        assert len(lookups) == counted
        assert not any(lookups[start:]), "a key look-up ran on the event loop"
        for client in (bad, other, admin, mine):
            client.close()
    engine.dispose()
