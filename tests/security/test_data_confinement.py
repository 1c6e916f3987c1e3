"""Data confinement (issue 20 §4): a tenant names only places under its own prefix.

A real API (uvicorn, SQLite registry) over a real ``file://`` object store with an extra
file root, and over a real S3 store (moto) with an extra allowed bucket. Two tenants,
``alice`` and ``bob``: bob tries to register, read and write alice's data with every
spelling of a URI that a store might read differently from the check (``..``, encoded
``..``, ``?``, ``#``, symbolic links). Each refusal must be the same answer whether or
not alice's object exists (and whatever it holds), and no answer may name a server path
other than what the caller itself sent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest

from ember.api.app import create_app
from ember.batch import datasets
from ember.config import Settings
from ember.errors import StoreAccessDenied
from ember.loader import stores
from tests import services
from tests.api.conftest import ADMIN_KEY, MLP, Api
from tests.api.conftest import api as api  # the fixtures
from tests.api.conftest import store_dir as store_dir
from tests.artifacts import write_valid

DENIED = "https://ember.dev/problems/store-access-denied"
INVALID = "https://ember.dev/problems/invalid-input"


@pytest.fixture
def registry_url(data_dir: Path) -> str:
    return f"sqlite:///{data_dir / 'registry.db'}"


@pytest.fixture
def extra_root(tmp_path: Path) -> Path:
    path = tmp_path / "shared-root"
    path.mkdir()
    return path


@pytest.fixture
def api_settings(data_dir: Path, registry_url: str, store_dir: Path, extra_root: Path) -> Settings:
    return Settings(
        data_dir=data_dir,
        database_url=registry_url,
        admin_key=ADMIN_KEY,  # type: ignore[arg-type]
        file_roots=[extra_root],
        validate_inline_max_bytes=1024 * 1024,
        pools_enabled=False,
    )


def version(uri: str, name: str = "1") -> dict[str, object]:
    return {"version": name, "artifact_uri": uri, "engine": "torch", "engine_config": MLP}


def register(client: httpx.Client, uri: str, model: str = "m", name: str = "1") -> httpx.Response:
    client.post("/v1/models", json={"name": model})
    return client.post(f"/v1/models/{model}/versions", json=version(uri, name))


def same_answer(a: httpx.Response, uri_a: str, b: httpx.Response, uri_b: str) -> dict[str, object]:
    """Two answers that differ in nothing but the URI each request named."""
    assert a.status_code == b.status_code, (a.text, b.text)
    text_a = json.dumps(a.json(), sort_keys=True).replace(uri_a, "<uri>")
    text_b = json.dumps(b.json(), sort_keys=True).replace(uri_b, "<uri>")
    assert text_a == text_b
    body: dict[str, object] = a.json()
    return body


def no_server_path(response: httpx.Response, settings: Settings, *sent: str) -> None:
    """The answer names no server path, once what the caller sent itself is taken out."""
    text = response.text
    for given in sorted(sent, key=len, reverse=True):
        text = text.replace(given, "").replace(json.dumps(given)[1:-1], "")
    for secret in {str(settings.data_dir), os.path.realpath(settings.data_dir)}:
        assert secret not in text, response.text


def refused(response: httpx.Response, kind: str = DENIED) -> dict[str, object]:
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, object] = response.json()
    assert body["type"] == kind, body
    return body


@pytest.fixture
def tenants(api: Api, store_dir: Path) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    alice, bob = api.tenant_client("alice"), api.tenant_client("bob")
    with alice, bob:
        yield alice, bob


def alice_artifacts(store_dir: Path) -> dict[str, Path]:
    """alice's files in the store: a valid artifact, a corrupt one, one that is not there."""
    base = store_dir / "artifacts" / "alice" / "m" / "1"
    good = write_valid(base / "model.safetensors")
    bad = base / "corrupt.safetensors"
    bad.write_bytes(b"not safetensors, and 1 byte longer than the valid one's header")
    return {"good": good, "corrupt": bad, "missing": base / "missing.safetensors"}


# --- registering another tenant's artifact ------------------------------------------------


def test_a_tenant_cannot_register_another_tenants_artifact(
    api: Api, tenants: tuple[httpx.Client, httpx.Client], store_dir: Path
) -> None:
    alice, bob = tenants
    files = alice_artifacts(store_dir)
    own = register(alice, files["good"].as_uri())  # alice's own registration still works
    assert own.status_code == 201, own.text
    answers = {k: register(bob, p.as_uri()) for k, p in files.items()}
    body = refused(answers["good"])
    assert "'bob'" in str(body["detail"])
    # An existence, size or header oracle would show as a difference here.
    same_answer(answers["good"], files["good"].as_uri(), answers["missing"],
                files["missing"].as_uri())  # fmt: skip
    same_answer(answers["good"], files["good"].as_uri(), answers["corrupt"],
                files["corrupt"].as_uri())  # fmt: skip
    for key, response in answers.items():
        no_server_path(response, api.settings, files[key].as_uri())
    assert bob.get("/v1/models/m/versions/1").status_code == 404  # nothing stored
    # An admin (also acting for bob) keeps the operator's rule: any allowed location.
    admin_for_bob = api.admin.post(
        "/v1/models/m/versions",
        json=version(files["good"].as_uri()),
        headers={"X-Ember-Tenant": "bob"},
    )
    assert admin_for_bob.status_code == 201, admin_for_bob.text


def test_extra_file_roots_are_divided_by_tenant(
    api: Api, tenants: tuple[httpx.Client, httpx.Client], extra_root: Path
) -> None:
    _, bob = tenants
    mine = write_valid(extra_root / "bob" / "w.safetensors")
    theirs = write_valid(extra_root / "alice" / "w.safetensors")
    top = write_valid(extra_root / "w.safetensors")
    assert register(bob, mine.as_uri(), name="1").status_code == 201
    for path in (theirs, top):
        answer = register(bob, path.as_uri(), name="2")
        refused(answer)
        missing = path.with_name("nothing.safetensors")
        same_answer(answer, path.as_uri(), register(bob, missing.as_uri(), name="2"),
                    missing.as_uri())  # fmt: skip
        no_server_path(answer, api.settings, path.as_uri())


# --- URIs a store would read differently from the check -----------------------------------


def test_traversal_and_encoding_tricks_are_refused_before_any_io(
    api: Api, tenants: tuple[httpx.Client, httpx.Client], store_dir: Path
) -> None:
    _, bob = tenants
    files = alice_artifacts(store_dir)
    mine = store_dir / "artifacts" / "bob"
    own = write_valid(mine / "own.safetensors")
    prefix = mine.as_uri()
    for target in ("model.safetensors", "missing.safetensors"):
        tricks = [
            f"{prefix}/../alice/m/1/{target}",
            f"{prefix}/%2e%2e/alice/m/1/{target}",
            f"{prefix}/%2E%2E%2Falice/m/1/{target}",
            f"{prefix}/.%2e/alice/m/1/{target}",
            f"{prefix}/x/./../../alice/m/1/{target}",
            f"{prefix}//../alice/m/1/{target}",
            f"{prefix}/%5C..%5Calice/m/1/{target}",
            f"{prefix}/own.safetensors%00/../../alice/m/1/{target}",
            f"{prefix}/x?/../../alice/m/1/{target}",
            f"{prefix}/x#/../../alice/m/1/{target}",
            f"{own.as_uri()}?{target}",
            f"{own.as_uri()}#{target}",
        ]
        for uri in tricks:
            answer = register(bob, uri)
            refused(answer)
            no_server_path(answer, api.settings, uri)
    # The same refusal whether the target exists or not (the URI is all that differs).
    a = f"{prefix}/%2e%2e/alice/m/1/model.safetensors"
    b = f"{prefix}/%2e%2e/alice/m/1/missing.safetensors"
    same_answer(register(bob, a), a, register(bob, b), b)
    assert bob.get("/v1/models/m/versions/1").status_code == 404
    assert files["good"].exists()


def test_links_out_of_the_prefix_are_refused_without_an_oracle(
    api: Api, tenants: tuple[httpx.Client, httpx.Client], store_dir: Path
) -> None:
    _, bob = tenants
    files = alice_artifacts(store_dir)
    (store_dir / "artifacts" / "alice" / "dir").mkdir()
    mine = store_dir / "artifacts" / "bob"
    own = write_valid(mine / "own.safetensors")
    links = {
        "to-file": files["good"],
        "to-missing": files["missing"],
        "to-corrupt": files["corrupt"],
        "relative": Path("../alice/m/1/model.safetensors"),
        "relative-missing": Path("../alice/m/1/missing.safetensors"),
        # Out and back in: the kernel would follow it only if alice has `dir`.
        "out-and-back": Path("../alice/dir/../../bob/own.safetensors"),
        "out-and-back-missing": Path("../alice/nodir/../../bob/own.safetensors"),
        "dir": files["good"].parent,
    }
    for name, target in links.items():
        (mine / name).symlink_to(target)
    answers: dict[str, tuple[str, httpx.Response]] = {}
    for name in links:
        uri = (mine / name).as_uri() + ("/model.safetensors" if name == "dir" else "")
        answers[name] = (uri, register(bob, uri))
    for uri, answer in answers.values():
        refused(answer)
        no_server_path(answer, api.settings, uri)
    for a, b in [("to-file", "to-missing"), ("to-file", "to-corrupt"),
                 ("relative", "relative-missing"), ("out-and-back", "out-and-back-missing"),
                 ("to-file", "dir")]:  # fmt: skip
        same_answer(answers[a][1], answers[a][0], answers[b][1], answers[b][0])
    # A link that stays inside the tenant's own prefix is followed.
    (mine / "alias.safetensors").symlink_to("own.safetensors")
    ok = register(bob, (mine / "alias.safetensors").as_uri(), name="9")
    assert ok.status_code == 201, ok.text
    assert ok.json()["size_bytes"] == own.stat().st_size


def test_no_error_names_a_server_path(
    api: Api, tenants: tuple[httpx.Client, httpx.Client], store_dir: Path
) -> None:
    _, bob = tenants
    mine = store_dir / "artifacts" / "bob"
    corrupt = mine / "corrupt.safetensors"
    corrupt.parent.mkdir(parents=True)
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    cases = [
        "file:///etc/passwd",
        "file://otherhost/etc/passwd",
        "file:relative/path",
        "s3://someone-elses-bucket/model.safetensors",
        "http://example.com/w.safetensors",
        (mine / "absent.safetensors").as_uri(),
    ]
    for uri in cases:
        answer = register(bob, uri)
        assert answer.status_code == 422, answer.text
        no_server_path(answer, api.settings, uri)
    # A tenant's own corrupt artifact: the answer describes the artifact, not the server.
    answer = register(bob, corrupt.as_uri())
    body = refused(answer, "https://ember.dev/problems/invalid-artifact")
    assert "JSON" in str(body["detail"])
    no_server_path(answer, api.settings, corrupt.as_uri())


# --- job inputs -------------------------------------------------------------------------


def deployed(client: httpx.Client, store_dir: Path, tenant: str) -> None:
    artifact = write_valid(store_dir / "artifacts" / tenant / "clf" / "1" / "w.safetensors")
    assert register(client, artifact.as_uri(), model="clf").status_code == 201
    created = client.post("/v1/deployments", json={"model": "clf", "version": "1"})
    assert created.status_code == 201, created.text


def test_a_job_cannot_read_another_tenants_input(
    api: Api, tenants: tuple[httpx.Client, httpx.Client], store_dir: Path
) -> None:
    _, bob = tenants
    deployed(bob, store_dir, "bob")
    theirs = store_dir / "job-inputs" / "alice" / "in.json"
    theirs.parent.mkdir(parents=True)
    theirs.write_text(json.dumps({"instances": [[1.0, 2.0]]}))
    missing = theirs.with_name("gone.json")
    mine = store_dir / "job-inputs" / "bob"
    mine.mkdir(parents=True)
    (mine / "link.json").symlink_to(theirs)
    (mine / "link-missing.json").symlink_to(missing)

    def submit(uri: str) -> httpx.Response:
        return bob.post("/v1/jobs", json={"model": "clf", "input_uri": uri})

    direct, direct_missing = submit(theirs.as_uri()), submit(missing.as_uri())
    refused(direct, INVALID)
    same_answer(direct, theirs.as_uri(), direct_missing, missing.as_uri())
    link, link_missing = (mine / "link.json").as_uri(), (mine / "link-missing.json").as_uri()
    through_link, through_missing = submit(link), submit(link_missing)
    refused(through_link, INVALID)
    same_answer(through_link, link, through_missing, link_missing)
    tricky = f"{mine.as_uri()}/x#/../../alice/in.json"
    refused(submit(tricky), INVALID)
    for response, uri in [(direct, theirs.as_uri()), (through_link, link),
                          (direct_missing, missing.as_uri())]:  # fmt: skip
        no_server_path(response, api.settings, uri)
    assert bob.get("/v1/jobs").json()["items"] == []


# --- batch datasets and outputs -------------------------------------------------------------


def test_batch_uris_cannot_leave_their_prefix(
    api: Api, tenants: tuple[httpx.Client, httpx.Client], store_dir: Path
) -> None:
    alice, bob = tenants
    deployed(bob, store_dir, "bob")
    prefix = (store_dir / "batch" / "bob").as_uri()
    (store_dir / "batch" / "bob").mkdir(parents=True)
    (store_dir / "batch" / "bob" / "in.jsonl").write_text('{"id": 1, "features": [1]}\n')
    (store_dir / "batch" / "alice").mkdir(parents=True)
    (store_dir / "batch" / "bob" / "elsewhere").symlink_to(store_dir / "batch" / "alice")

    def schedule(name: str, **uris: str) -> httpx.Response:
        body = {
            "name": name,
            "cron": "0 2 * * *",
            "model": "clf",
            "paused": True,
            "input_uri": f"{prefix}/in.jsonl",
            "output_uri": f"{prefix}/out",
        } | uris
        return bob.post("/v1/batch/schedules", json=body)  # fmt: skip

    outputs = [
        f"{prefix}/..#",
        f"{prefix}/out/..#",
        f"{prefix}/..?",
        f"{prefix}/out?",
        f"{prefix}/out?/{{date}}",
        f"{prefix}/out#frag",
        f"{prefix}/%2e%2e/alice",
        f"{prefix}/elsewhere/out",
        (store_dir / "batch" / "alice" / "out").as_uri(),
    ]
    inputs = [
        f"{prefix}/in-?.jsonl",
        f"{prefix}/..#/alice/in.jsonl",
        f"{prefix}/elsewhere/in.jsonl",
        (store_dir / "batch" / "alice" / "in.jsonl").as_uri(),
    ]
    cases = [("output_uri", u) for u in outputs] + [("input_uri", u) for u in inputs]
    for i, (field, uri) in enumerate(cases):
        uris = {"input_uri": f"{prefix}/in.jsonl", "output_uri": f"{prefix}/out", field: uri}
        answer = schedule(f"s{i}", **uris)
        refused(answer, INVALID)
        no_server_path(answer, api.settings, *uris.values())
    own = schedule("own")
    assert own.status_code == 201, own.text
    assert alice.get("/v1/batch/schedules").json()["items"] == []


def test_each_part_lands_in_its_own_object(tmp_path: Path) -> None:
    """The workers' writes parse a part's URI as the check did: a ``?`` or ``#`` in an
    output prefix can no longer put every part onto one file."""
    settings = Settings(data_dir=tmp_path / "data")
    out = (settings.data_dir / "objects" / "batch" / "bob" / "out").as_uri()
    for prefix in (f"{out}?", f"{out}#", f"{out}/..#", f"{out}/x%2f.."):
        for n in (0, 1):
            with pytest.raises(StoreAccessDenied):
                datasets.write_bytes(settings, f"{prefix}/br_1/part-{n:05d}.jsonl", b"x")
    assert not (settings.data_dir / "objects" / "batch" / "bob" / "out").exists()
    assert not (settings.data_dir / "objects" / "batch" / "bob").exists()
    for n in (0, 1):
        datasets.write_bytes(settings, f"{out}/br_1/part-{n:05d}.jsonl", f"{n}".encode())
    parts = sorted((settings.data_dir / "objects" / "batch" / "bob" / "out" / "br_1").iterdir())
    assert [p.read_text() for p in parts] == ["0", "1"]


def test_an_extra_root_that_holds_server_data_gives_no_tenant_that_part(tmp_path: Path) -> None:
    """An extra file root above the data directory: the tenant named like the data
    directory gets no prefix there (it would read the registry and the weight cache)."""
    settings = Settings(data_dir=tmp_path / "ember", file_roots=[tmp_path])
    assert (tmp_path / "bob").as_uri() + "/" in stores.tenant_prefixes(settings, "bob")
    assert (tmp_path / "ember").as_uri() + "/" not in stores.tenant_prefixes(settings, "ember")
    registry = (tmp_path / "ember" / "registry.db").as_uri()
    with pytest.raises(StoreAccessDenied):
        stores.check_location(registry, settings, tenant="ember")
    stores.check_location(registry, settings)  # the operator's own rule is unchanged


# --- the S3 store -------------------------------------------------------------------------

BUCKET, SHARED = "ember-confined", "ember-confined-shared"


@pytest.fixture
def s3_api(data_dir: Path, registry_url: str, moto_endpoint: str) -> Iterator[Api]:
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    for bucket in (BUCKET, SHARED, "ember-confined-other"):
        s3.create_bucket(Bucket=bucket)
    settings = Settings(
        data_dir=data_dir,
        database_url=registry_url,
        admin_key=ADMIN_KEY,  # type: ignore[arg-type]
        object_store_url=f"s3://{BUCKET}/store",
        s3_endpoint_url=moto_endpoint,
        s3_allowed_buckets=[SHARED, "ember-confined-other"],
        validate_inline_max_bytes=1024 * 1024,
        pools_enabled=False,
    )
    with (
        services.serve_app(create_app(settings)) as url,
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin,
    ):
        yield Api(url, admin, settings)


@pytest.mark.s3
def test_s3_prefixes_are_per_tenant(s3_api: Api, moto_endpoint: str, tmp_path: Path) -> None:
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    artifact = write_valid(tmp_path / "w.safetensors")
    keys = {
        "alice-store": (BUCKET, "store/artifacts/alice/m/1/model.safetensors"),
        "alice-shared": (SHARED, "alice/model.safetensors"),
        "bob-store": (BUCKET, "store/artifacts/bob/m/1/model.safetensors"),
        "bob-shared": (SHARED, "bob/model.safetensors"),
        "top-shared": (SHARED, "model.safetensors"),
        "other-bucket": ("ember-confined-other", "store/artifacts/bob/model.safetensors"),
    }
    for bucket, key in keys.values():
        s3.upload_file(str(artifact), bucket, key)
    uri = {name: f"s3://{b}/{k}" for name, (b, k) in keys.items()}
    alice, bob = s3_api.tenant_client("alice"), s3_api.tenant_client("bob")
    with alice, bob:
        assert register(alice, uri["alice-store"]).status_code == 201
        assert register(bob, uri["bob-store"], name="1").status_code == 201
        assert register(bob, uri["bob-shared"], name="2").status_code == 201
        for name in ("alice-store", "alice-shared", "top-shared"):
            answer = register(bob, uri[name], name="3")
            refused(answer)
            missing = uri[name].replace("model.safetensors", "missing.safetensors")
            same_answer(answer, uri[name], register(bob, missing, name="3"), missing)
        tricks = [
            f"s3://{BUCKET}/store/artifacts/bob/../alice/m/1/model.safetensors",
            f"s3://{BUCKET}/store/artifacts/bob/%2e%2e/alice/m/1/model.safetensors",
            f"s3://{BUCKET}/store/artifacts/bob//m/1/model.safetensors",
            f"s3://{BUCKET}/store/artifacts/bob/m/1/model.safetensors?versionId=1",
            f"s3://{BUCKET}/store/artifacts/bob/m/1/model.safetensors#x",
            f"s3://{SHARED}/bob/../alice/model.safetensors",
            uri["other-bucket"],  # a bucket the operator allowed, but not bob's prefix in it
            "s3://not-allowed-anywhere/bob/model.safetensors",
        ]
        for trick in tricks:
            refused(register(bob, trick, name="4"))
        # The admin keeps the operator's rule.
        admin = s3_api.admin.post(
            "/v1/models/m/versions",
            json=version(uri["alice-shared"], "5"),
            headers={"X-Ember-Tenant": "bob"},
        )
        assert admin.status_code == 201, admin.text


# --- the tenant's own push ----------------------------------------------------------------


def test_a_tenants_own_push_lands_under_its_prefix_and_registers(
    api: Api, tenants: tuple[httpx.Client, httpx.Client], store_dir: Path, tmp_path: Path
) -> None:
    _, bob = tenants
    artifact = write_valid(tmp_path / "push" / "w.safetensors")
    env = {
        "PATH": os.environ.get("PATH", ""),
        "EMBER_DATA_DIR": str(api.settings.data_dir),
        "EMBER_URL": api.url,
        "EMBER_API_KEY": str(bob.headers["Authorization"]).removeprefix("Bearer "),
    }
    ember = str(Path(sys.executable).with_name("ember"))
    pushed = subprocess.run(
        [ember, "models", "push", str(artifact), "-n", "pushed", "-v", "1",
         "--engine", "torch", "--engine-config", json.dumps(MLP)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    got = bob.get("/v1/models/pushed/versions/1").json()
    assert got["status"] == "ready"
    assert (
        got["artifact_uri"]
        == (store_dir / "artifacts" / "bob" / "pushed" / "1" / "w.safetensors").as_uri()
    )
