"""Models and versions over the real API, on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import httpx

from tests.api.conftest import MLP, Api
from tests.artifacts import write_valid


def problem(response: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, object] = response.json()
    assert body["type"] == f"https://ember.dev/problems/{code}", body
    assert body["status"] == status and body["detail"] and body["title"]
    return body


def register(api: Api, store_dir: Path, model: str = "minilm", version: str = "1") -> dict:
    api.admin.post("/v1/models", json={"name": model})
    path = write_valid(store_dir / model / version / "model.safetensors")
    body = {
        "version": version,
        "artifact_uri": path.as_uri(),
        "engine": "torch",
        "engine_config": MLP,
    }
    response = api.admin.post(f"/v1/models/{model}/versions", json=body)
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_health_needs_no_key_but_everything_else_does(api: Api) -> None:
    anon = api.client(None)
    assert anon.get("/healthz").json()["status"] == "ok"
    assert anon.get("/readyz").json() == {"status": "ready"}
    body = problem(anon.get("/v1/models"), 401, "unauthenticated")
    assert "Bearer" in str(body["detail"])
    problem(api.client("ek_not-a-real-key").get("/v1/models"), 401, "unauthenticated")


def test_model_lifecycle_and_pagination(api: Api) -> None:
    for i in range(5):
        created = api.admin.post("/v1/models", json={"name": f"m{i}", "description": "d"})
        assert created.status_code == 201, created.text
    problem(api.admin.post("/v1/models", json={"name": "m0"}), 409, "conflict")
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = api.admin.get("/v1/models", params=params).json()
        seen += [m["name"] for m in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"m{i}" for i in range(5)]
    assert api.admin.get("/v1/models/m3").json()["description"] == "d"
    assert api.admin.delete("/v1/models/m3").status_code == 204
    problem(api.admin.get("/v1/models/m3"), 404, "not-found")
    problem(api.admin.get("/v1/models", params={"cursor": "garbage!"}), 422, "invalid-input")


def test_register_version_records_digest_size_and_tensors(api: Api, store_dir: Path) -> None:
    version = register(api, store_dir)
    path = store_dir / "minilm" / "1" / "model.safetensors"
    assert version["status"] == "ready"
    assert version["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert version["size_bytes"] == path.stat().st_size
    assert version["tensor_count"] == 3
    listed = api.admin.get("/v1/models/minilm/versions").json()["items"]
    assert [v["version"] for v in listed] == ["1"]
    model = api.admin.get("/v1/models/minilm").json()
    assert model["version_count"] == 1 and model["latest_version"] == "1"


def test_duplicate_version_is_a_conflict_and_keeps_the_original(api: Api, store_dir: Path) -> None:
    first = register(api, store_dir)
    other = write_valid(store_dir / "other.safetensors", tensors=5)
    body = {"version": "1", "artifact_uri": other.as_uri(), "engine": "torch", "engine_config": MLP}
    problem(api.admin.post("/v1/models/minilm/versions", json=body), 409, "conflict")
    assert api.admin.get("/v1/models/minilm/versions/1").json()["sha256"] == first["sha256"]


def test_supplied_sha256_is_checked(api: Api, store_dir: Path) -> None:
    api.admin.post("/v1/models", json={"name": "m"})
    path = write_valid(store_dir / "a.safetensors")
    body = {
        "version": "1",
        "artifact_uri": path.as_uri(),
        "engine": "torch",
        "engine_config": MLP,
        "sha256": "0" * 64,
    }
    detail = problem(api.admin.post("/v1/models/m/versions", json=body), 422, "invalid-artifact")
    assert "sha256 mismatch" in str(detail["detail"])
    problem(api.admin.get("/v1/models/m/versions/1"), 404, "not-found")  # nothing stored
    body["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    assert api.admin.post("/v1/models/m/versions", json=body).status_code == 201


def _wait_status(api: Api, path: str, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        version = dict(api.admin.get(path).json())
        if version["status"] != "pending":
            return version
        time.sleep(0.05)
    raise AssertionError(f"{path} still pending after {timeout_s}s")


def test_large_artifacts_validate_in_the_background(api: Api, store_dir: Path) -> None:
    api.admin.post("/v1/models", json={"name": "big"})
    path = write_valid(store_dir / "big.safetensors", tensors=4, rows=16 * 1024)  # ~2 MiB
    body = {"version": "1", "artifact_uri": path.as_uri(), "engine": "torch", "engine_config": MLP}
    response = api.admin.post("/v1/models/big/versions", json=body)
    assert response.status_code == 202, response.text
    assert response.json()["status"] == "pending"
    assert response.headers["location"] == "/v1/models/big/versions/1"
    done = _wait_status(api, "/v1/models/big/versions/1")
    assert done["status"] == "ready" and done["tensor_count"] == 4
    assert done["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_background_validation_failure_is_recorded_with_reason(api: Api, store_dir: Path) -> None:
    api.admin.post("/v1/models", json={"name": "big"})
    path = write_valid(store_dir / "big.safetensors", tensors=2, rows=32 * 1024)
    with path.open("r+b") as fh:  # corrupt the end: the data section no longer matches
        fh.truncate(path.stat().st_size - 7)
    body = {"version": "1", "artifact_uri": path.as_uri(), "engine": "torch", "engine_config": MLP}
    assert api.admin.post("/v1/models/big/versions", json=body).status_code == 202
    failed = _wait_status(api, "/v1/models/big/versions/1")
    assert failed["status"] == "failed"
    assert "out of range" in failed["status_reason"] or "truncated" in failed["status_reason"]


def test_tenants_see_only_their_own_models(api: Api, store_dir: Path) -> None:
    register(api, store_dir, "shared-name")
    alice, bob = api.tenant_client("alice"), api.tenant_client("bob")
    assert alice.post("/v1/models", json={"name": "secret"}).status_code == 201
    assert [m["name"] for m in bob.get("/v1/models").json()["items"]] == []
    problem(bob.get("/v1/models/secret"), 404, "not-found")
    problem(bob.delete("/v1/models/secret"), 404, "not-found")
    problem(bob.get("/v1/models/shared-name"), 404, "not-found")
    assert bob.post("/v1/models", json={"name": "secret"}).status_code == 201  # own namespace
    assert alice.get("/v1/whoami").json() == {"tenant": "alice", "scope": "tenant"}
    problem(alice.post("/v1/tenants", json={"name": "eve"}), 403, "forbidden")
    problem(alice.get("/v1/models", headers={"X-Ember-Tenant": "bob"}), 403, "forbidden")
    as_bob = api.admin.get("/v1/models", headers={"X-Ember-Tenant": "bob"}).json()
    assert [m["name"] for m in as_bob["items"]] == ["secret"]


def test_revoked_keys_stop_working(api: Api) -> None:
    created = api.admin.post("/v1/keys", json={"name": "ci"}).json()
    assert created["key"].startswith("ek_") and created["scope"] == "tenant"
    listed = api.admin.get("/v1/keys").json()["items"]
    assert all("key" not in k and "key_hash" not in k for k in listed)
    client = api.client(created["key"])
    assert client.get("/v1/models").status_code == 200
    assert api.admin.delete(f"/v1/keys/{created['id']}").json()["revoked_at"] is not None
    problem(client.get("/v1/models"), 401, "unauthenticated")
    problem(api.admin.delete("/v1/keys/99999"), 404, "not-found")
    problem(api.admin.delete("/v1/keys/99999999999999999999999"), 422, "invalid-input")


def test_a_key_revoked_by_another_api_process_is_refused_before_its_cache_entry_ends(
    api: Api,
) -> None:
    """A second API process on the same registry keeps a key in use fresh by re-checking
    it in the background: a revocation elsewhere is seen at that re-check, before the
    cached entry would have run out."""
    from ember.api.app import create_app
    from ember.registry.security import hash_key
    from tests import services

    created = api.admin.post("/v1/keys", json={"name": "elsewhere"}).json()
    other = create_app(api.settings)
    with services.serve_app(other) as url, httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {created['key']}"}, timeout=30
    ) as client:  # fmt: skip
        assert client.get("/v1/models").status_code == 200
        expires = other.state.principals.entries[(hash_key(created["key"]), None)][0]
        assert api.admin.delete(f"/v1/keys/{created['id']}").status_code == 200
        status = 200
        while status == 200 and time.monotonic() < expires + 5:
            time.sleep(0.05)
            status = client.get("/v1/models").status_code
        refused_at = time.monotonic()
    assert status == 401
    assert refused_at < expires  # the re-check, not the expiry, refused it
