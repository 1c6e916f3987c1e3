"""The cross-tenant access matrix: every route of the OpenAPI document, by who calls it.

The routes come from the API's OpenAPI document (built at collection time from the same
code; ``test_the_served_document_is_the_one_the_matrix_covers`` checks the running API
serves exactly that one). Every operation gets these cells, with the answer derived from
one rule (``scopes_of``) rather than listed by hand:

- ``owner``: alice, with the least privileged key the route takes, on her own resources:
  her tenant key; the worker key acting for her (``X-Ember-Tenant``) on ``:batch-lane``;
  the admin key acting for her on cost-model writes; the admin key on the tenants
  routes. The route works (its answer in ``WRITES`` for the write routes, else 200).
  Not run on DELETE routes (the resources are shared by the package).
- ``other-tenant``: bob, the same kind of key, on alice's resources: 404 on every route
  naming one of them in its path or body (another tenant's resources are invisible: a 403
  would tell they exist); on the other routes (lists, his own settings, ``/metrics``) his
  own answer, which never carries anything of alice's. The tenants routes: 403.
- ``no-key``: 401 on every route but the public ones (probes, the OpenAPI document).
- ``wrong-scope-tenant`` / ``wrong-scope-worker``: a scope the route does not take: 403
  (alice's tenant key on the tenants routes, cost-model writes and ``:batch-lane``, or
  minting an admin or a worker key; the worker key on the control plane: everything but
  the data plane and ``:batch-lane``).
- ``worker-for-owner``: the worker key acting for alice (``X-Ember-Tenant``) on the data
  plane: what alice gets.
- ``other-tenant-as-owner``: bob's key sending ``X-Ember-Tenant: alice``: 403.
- ``default-tenant…``: a tenant key of the default tenant, where the admin and worker keys
  live: it neither lists nor revokes them (404).

A write by anyone but the owner leaves the owner's resource as it was (its ``GET``, or
its nearest ancestor's, answers the same before and after): a DELETE deletes nothing.
A route the rule cannot place, a path parameter it cannot fill or a write route without
a body in ``WRITES`` is a failing cell: the matrix stays complete as routes are added.
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.security.conftest import INPUT_SCHEMA, MLP_CONFIG, SecurityPlatform, Tenant, X

ADMIN, TENANT, WORKER = "admin", "tenant", "worker"
Scopes = frozenset[str]
ALL: Scopes = frozenset({ADMIN, TENANT, WORKER})
CONTROL: Scopes = frozenset({ADMIN, TENANT})
PRIVILEGED: Scopes = frozenset({ADMIN, WORKER})
ADMIN_ONLY: Scopes = frozenset({ADMIN})

#: Served without a key: liveness and readiness probes, KServe's server metadata.
PUBLIC = {("GET", p) for p in ("/healthz", "/readyz", "/v2", "/v2/health/live", "/v2/health/ready")}
#: Served without a key and left out of the document: the document and its viewers.
UNDOCUMENTED = {("GET", p) for p in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")}
#: The dashboard's static files (ember/api/ui: no data; its JSON is documented and in the matrix).
UNDOCUMENTED |= {("GET", p) for p in ("/ui", "/ui/", "/ui/static/{path:path}")}
#: The data plane (tenant, admin and worker keys; the worker acts for a job's tenant).
DATA_PLANE = re.compile(r"(:predict$)|(^/v2/models/)|(^/openai/v1/)")


class Unplaced(Exception):
    """The matrix has no rule for this route (a new route: extend the rule)."""


def scopes_of(method: str, path: str) -> Scopes | None:
    """The scopes of the keys that may call a route; None: public (no key needed)."""
    if (method, path) in PUBLIC | UNDOCUMENTED:
        return None
    if path.startswith("/v1/tenants") or "/cost-models/" in path:
        return ADMIN_ONLY
    if path.endswith(":batch-lane"):
        return PRIVILEGED
    if DATA_PLANE.search(path) or path == "/metrics":
        return ALL
    if path.startswith("/v1/"):
        return CONTROL
    raise Unplaced(f"no access rule for {method} {path}: extend scopes_of")


def tenant_scoped(path: str) -> bool:
    """The route acts on one tenant's resources (an admin names the tenant with
    ``X-Ember-Tenant``); the tenants routes are the operator's own."""
    return not path.startswith("/v1/tenants")


# --- path parameters: the owner's resources -----------------------------------------------

#: (template prefix, parameter) → the owner's value. The first match wins.
PARAMS: list[tuple[str, str, Callable[[SecurityPlatform, Tenant], str]]] = [
    ("/v1/models/", "name", lambda p, t: t.model),
    ("/v2/models/", "name", lambda p, t: t.model),
    ("/v1/models/", "version", lambda p, t: t.version),
    ("/v2/models/", "version", lambda p, t: t.version),
    ("/v1/models/", "hardware", lambda p, t: "cpu"),
    ("/v1/deployments/", "name", lambda p, t: t.deployment),
    ("/openai/v1/models/", "model", lambda p, t: t.deployment),
    ("/v1/jobs/", "job_id", lambda p, t: t.job_id),
    ("/v1/batch/schedules/", "name", lambda p, t: t.schedule),
    ("/v1/batch/runs/", "run_id", lambda p, t: t.run_id),
    ("/v1/keys/", "key_id", lambda p, t: str(t.spare_key_id)),
    ("/v1/tenants/", "name", lambda p, t: t.name),
]
#: Parameters that name no resource of anyone's.
NEUTRAL_PARAMS = {"hardware"}


def params_of(path: str) -> list[str]:
    return re.findall(r"\{(\w+)\}", path)


def fill(platform: SecurityPlatform, path: str, owner: Tenant) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        for prefix, param, get in PARAMS:
            if param == name and path.startswith(prefix):
                return get(platform, owner)
        raise Unplaced(f"cannot fill {{{name}}} of {path}: extend PARAMS")

    return re.sub(r"\{(\w+)\}", value, path)


def names_resource(path: str) -> bool:
    return any(p not in NEUTRAL_PARAMS for p in params_of(path))


# --- bodies of the write routes -----------------------------------------------------------

Expect = int | frozenset[int]
Body = Callable[[Tenant], Any]
Cleanup = Callable[[httpx.Client, Tenant, httpx.Response], httpx.Response]


@dataclass(frozen=True)
class Write:
    body: Body | None
    """Built for the owner's resources (the caller's, for ``other_body``)."""
    owner: Expect
    names_owner: bool = False
    """The body names the owner's resources: the other tenant gets 404."""
    other_body: Body | None = None
    other: Expect | None = None
    """The other tenant's answer where the rule does not give it."""
    other_echoes_owner: bool = False
    """The other tenant's answer carries the owner's name legitimately (it is his own now)."""
    cleanup: Cleanup | None = None
    """Undo a 2xx (by whoever got it), with the client that got it."""


def _tmp(t: Tenant) -> str:
    return f"{t.name}-tmp-{uuid.uuid4().hex[:8]}"


def _v2(t: Tenant) -> dict[str, Any]:
    return {"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": X}]}


def _schedule(t: Tenant) -> dict[str, Any]:
    return {"name": _tmp(t), "model": t.model, "input_uri": t.input_uri,
            "output_uri": t.output_uri, "cron": "0 3 * * *", "paused": True}  # fmt: skip


def _delete(path: Callable[[Tenant, httpx.Response], str]) -> Cleanup:
    return lambda client, t, r: client.delete(path(t, r))


PREDICT = Write(lambda t: {"instances": [X]}, 200)
INFER = Write(_v2, 200)
#: The MLP is neither an embedding nor a generative model: the owner is told so (422/400),
#: the other tenant that the model does not exist.
OPENAI_WRONG_KIND = frozenset({400, 422})

WRITES: dict[tuple[str, str], Write] = {
    ("POST", "/v1/models/{name}:predict"): PREDICT,
    ("POST", "/v1/models/{name}/versions/{version}:predict"): PREDICT,
    ("POST", "/v1/models/{name}/versions/{version}:batch-lane"): Write(lambda t: {"sent": 0}, 200),
    ("POST", "/v2/models/{name}/infer"): INFER,
    ("POST", "/v2/models/{name}/versions/{version}/infer"): INFER,
    ("POST", "/openai/v1/embeddings"): Write(
        lambda t: {"model": t.deployment, "input": "hello"}, OPENAI_WRONG_KIND, names_owner=True
    ),
    ("POST", "/openai/v1/completions"): Write(
        lambda t: {"model": t.deployment, "prompt": "hello", "max_tokens": 1},
        OPENAI_WRONG_KIND,
        names_owner=True,
    ),
    ("POST", "/openai/v1/chat/completions"): Write(
        lambda t: {
            "model": t.deployment,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
        },
        OPENAI_WRONG_KIND,
        names_owner=True,
    ),
    ("POST", "/v1/tenants"): Write(lambda t: {"name": f"matrix-{uuid.uuid4().hex[:8]}"}, 201),
    ("PATCH", "/v1/tenants/{name}"): Write(lambda t: {"trusted": False}, 200),
    ("POST", "/v1/keys"): Write(
        lambda t: {"name": "matrix"},
        201,
        other_body=lambda t: {"name": "matrix", "tenant": "alice"},
        other=403,  # a key for another tenant is an admin's to make
        cleanup=_delete(lambda t, r: f"/v1/keys/{r.json()['id']}"),
    ),
    ("POST", "/v1/models"): Write(
        lambda t: {"name": _tmp(t)},
        201,
        other_body=lambda t: {"name": "alice-clf"},  # names are per tenant: not a 409
        other=201,
        other_echoes_owner=True,
        cleanup=_delete(lambda t, r: f"/v1/models/{r.json()['name']}"),
    ),
    ("POST", "/v1/models/{name}/versions"): Write(
        lambda t: {
            "version": "99",
            "artifact_uri": t.artifact_uri,
            "engine": "torch",
            "engine_config": MLP_CONFIG,
            "input_schema": INPUT_SCHEMA,
        },
        201,
        cleanup=_delete(lambda t, r: f"/v1/models/{t.model}/versions/{r.json()['version']}"),
    ),
    ("PUT", "/v1/models/{name}/versions/{version}/cost-models/{hardware}"): Write(
        lambda t: {"alpha": 0.0, "beta": 0.0, "gamma": 1.0, "capacity_units_per_s": 10_000.0},
        200,
    ),
    ("POST", "/v1/deployments"): Write(
        lambda t: {
            "name": _tmp(t),
            "model": t.model,
            "version": t.version,
            "min_hot": 0,
            "scale_to_zero": True,
            "max_replicas": 1,
        },
        201,
        names_owner=True,
        cleanup=_delete(lambda t, r: f"/v1/deployments/{r.json()['name']}"),
    ),
    ("PATCH", "/v1/deployments/{name}"): Write(lambda t: {"max_replicas": 1}, 200),
    # One version has ever been production: each of these is refused as a conflict, so
    # the owner's cell proves the route reached her deployment without changing it.
    ("POST", "/v1/deployments/{name}:canary"): Write(lambda t: {"version": t.version}, 409),
    ("POST", "/v1/deployments/{name}:promote"): Write(None, 409),
    ("POST", "/v1/deployments/{name}:rollback"): Write(None, 409),
    ("POST", "/v1/jobs"): Write(
        lambda t: {"model": t.model, "inputs": {"instances": [X]}}, 202, names_owner=True
    ),
    ("POST", "/v1/webhooks/secret:rotate"): Write(None, 200),
    ("POST", "/v1/batch/schedules"): Write(
        _schedule,
        201,
        names_owner=True,
        cleanup=_delete(lambda t, r: f"/v1/batch/schedules/{r.json()['name']}"),
    ),
    ("POST", "/v1/batch/schedules/{name}/pause"): Write(None, 200),
    ("POST", "/v1/batch/schedules/{name}/resume"): Write(None, 200),
    ("POST", "/v1/batch/runs"): Write(lambda t: {"schedule": t.schedule}, 202, names_owner=True),
}
#: GET routes whose owner's answer is not 200.
OWNER_GET: dict[tuple[str, str], Expect] = {
    # The fixture's job is queued (no worker runs by default), or done where a test of
    # this package started one.
    ("GET", "/v1/jobs/{job_id}/result"): frozenset({200, 409}),
}


# --- the OpenAPI document -----------------------------------------------------------------


def _app() -> Any:
    """The API as the code builds it with the default settings (never started: no I/O)."""
    from ember.api.app import create_app
    from ember.config import Settings

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("EMBER_")}
    try:
        data_dir = Path(tempfile.gettempdir()) / "ember-security-openapi"
        return create_app(Settings(data_dir=data_dir))
    finally:
        os.environ.update(saved)


#: The API's OpenAPI document, from the code (collection time: no server runs yet).
DOCUMENT: dict[str, Any] = _app().openapi()
METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


def operations(document: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method in item
        if method in METHODS
    ]


OPERATIONS = operations(DOCUMENT)


# --- the cells ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    method: str
    path: str
    who: str

    def __str__(self) -> str:
        return f"{self.method} {self.path} {self.who}"


def whos(method: str, path: str) -> list[str]:
    """Who calls a route in the matrix (a route the rule cannot place: one failing cell)."""
    try:
        scopes = scopes_of(method, path)
    except Unplaced:
        return ["unplaced"]
    if scopes is None:
        return ["no-key"]
    cells = [] if method == "DELETE" else ["owner"]
    cells += ["other-tenant", "no-key"]
    cells += [f"wrong-scope-{s}" for s in (TENANT, WORKER) if s not in scopes]
    if WORKER in scopes and TENANT in scopes:
        cells.append("worker-for-owner")
    if TENANT in scopes:
        cells.append("other-tenant-as-owner")
    return cells + EXTRA_WHOS.get((method, path), [])


#: Cells beyond the rule's, for the keys of the default tenant (where the admin and the
#: worker keys live): privileged keys are invisible to, and not revocable by, its tenant keys;
#: a tenant key mints neither an admin nor a worker key.
EXTRA_WHOS: dict[tuple[str, str], list[str]] = {
    ("GET", "/v1/keys"): ["default-tenant"],
    ("DELETE", "/v1/keys/{key_id}"): [
        "default-tenant-on-admin-key",
        "default-tenant-on-worker-key",
    ],
    ("POST", "/v1/keys"): [
        "wrong-scope-tenant-mints-admin-key",
        "wrong-scope-tenant-mints-worker-key",
    ],
}

CELLS = [Cell(m, p, who) for m, p in OPERATIONS for who in whos(m, p)]
CELLS += [Cell(m, p, "no-key") for m, p in sorted(UNDOCUMENTED)]
# DELETE cells last, revocations of keys at the very end: one that wrongly succeeds
# takes out as little of the rest as it can.
CELLS.sort(key=lambda c: (c.method == "DELETE", c.path.startswith("/v1/keys")))


# --- running a cell -----------------------------------------------------------------------


@dataclass
class Request:
    client: httpx.Client
    path: str
    body: Any
    expect: Expect
    check_leak: bool
    """A 2xx must carry nothing of the owner's."""
    witness: bool
    """A write by someone else: the owner's resource must be unchanged."""
    cleanup: Cleanup | None = None
    as_tenant: Tenant | None = None


def _principal(platform: SecurityPlatform, who: str, scopes: Scopes, path: str) -> httpx.Client:
    alice, bob = platform.alice, platform.bob
    if who in ("owner", "other-tenant"):  # the least privileged scope the route takes
        tenant = alice if who == "owner" else bob
        if TENANT in scopes:
            return platform.client(tenant.key)
        if WORKER in scopes:
            return platform.client(platform.worker_key, act_as=tenant.name)
        if tenant_scoped(path):
            return platform.client(platform.admin_key, act_as=tenant.name)
        return platform.admin if who == "owner" else platform.client(bob.key)
    if who == "no-key":
        return platform.client(None)
    if who.startswith("wrong-scope-tenant"):
        return platform.client(alice.key)
    if who == "wrong-scope-worker":
        return platform.client(platform.worker_key)
    if who == "worker-for-owner":
        return platform.client(platform.worker_key, act_as=alice.name)
    if who == "other-tenant-as-owner":
        return platform.client(bob.key, act_as=alice.name)
    if who.startswith("default-tenant"):
        return platform.client(platform.default_key)
    raise AssertionError(f"unknown cell kind {who!r}")


def _owner_expect(method: str, path: str) -> Expect:
    if method in ("POST", "PUT", "PATCH"):
        return WRITES[(method, path)].owner
    return OWNER_GET.get((method, path), 200)


def plan(platform: SecurityPlatform, cell: Cell) -> Request:
    method, path, who = cell.method, cell.path, cell.who
    if who == "unplaced":
        scopes_of(method, path)  # raises Unplaced, naming the route
    scopes = scopes_of(method, path)
    alice, bob = platform.alice, platform.bob
    url = fill(platform, path, alice)
    write = WRITES.get((method, path))
    if method in ("POST", "PUT", "PATCH") and write is None:
        raise Unplaced(f"no body for {method} {path}: add it to WRITES")
    body = write.body(alice) if write is not None and write.body is not None else None
    client = platform.client(None) if scopes is None else _principal(platform, who, scopes, path)
    cleanup = write.cleanup if write is not None else None
    if scopes is None:  # public; /ui/ sends the browser on to /ui
        url = url.replace("{path:path}", "app.js")  # a dashboard file
        return Request(client, url, body, 308 if path == "/ui/" else 200, False, False)
    if who == "owner":
        return Request(client, url, body, _owner_expect(method, path), False, False, cleanup)
    witness = method != "GET"
    if who == "no-key":
        return Request(client, url, body, 401, False, witness, cleanup)
    if who in ("worker-for-owner",):
        return Request(client, url, body, _owner_expect(method, path), False, False, cleanup)
    if who.startswith("wrong-scope") or who == "other-tenant-as-owner":
        if who.endswith("mints-admin-key"):
            body = {"name": "matrix", "scope": "admin"}
        elif who.endswith("mints-worker-key"):
            body = {"name": "matrix", "scope": "worker"}
        return Request(client, url, body, 403, True, witness, cleanup)
    if who == "default-tenant":  # GET /v1/keys: neither the admin's key nor the worker's
        return Request(client, url, body, 200, True, False)
    if who.startswith("default-tenant-on-"):
        key_id = platform.admin_key_id if who.endswith("admin-key") else platform.worker_key_id
        return Request(client, f"/v1/keys/{key_id}", body, 404, True, True)
    assert who == "other-tenant", who
    if scopes == ADMIN_ONLY and not tenant_scoped(path):
        return Request(client, url, body, 403, True, witness, cleanup)
    if write is not None and write.other_body is not None:
        body = write.other_body(bob)
    if write is not None and write.other is not None:
        expect = write.other
    elif names_resource(path) or (write is not None and write.names_owner):
        expect = 404
    else:
        expect = _owner_expect(method, path)  # his own answer, without alice's
    leak = not (write is not None and write.other_echoes_owner)
    return Request(client, url, body, expect, leak, witness, cleanup, bob)


def _markers(platform: SecurityPlatform) -> list[str]:
    """What of alice's must never reach anyone else: her name (in all her resources'
    names), her job and run ids, her keys' prefixes, her webhook secret."""
    alice = platform.alice
    secret = platform.client(alice.key).get("/v1/webhooks/secret").json().get("secret", "")
    found = [alice.name, alice.job_id, alice.run_id, alice.key_prefix, alice.spare_key_prefix]
    return [m for m in (*found, secret) if m]


#: Fields of a resource that move by themselves (time, progress).
VOLATILE = {"updated_at", "started_at", "finished_at", "last_fired_at", "next_fire_at",
            "heartbeat_at", "progress", "shards", "counts"}  # fmt: skip


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def _witness(platform: SecurityPlatform, method: str, path: str) -> tuple[str, str] | None:
    """The owner's view of what a write on ``path`` would change: the ``GET`` of the
    path, or of its nearest ancestor that has one (the key a revocation names: who it is).
    """
    alice = platform.alice
    if path == "/v1/keys/{key_id}":
        return None  # the keys themselves are checked: see _key_still_works
    candidate = path.split(":", 1)[0]
    while candidate:
        if ("GET", candidate) in OPERATION_SET and names_resource(candidate):
            return alice.key, fill(platform, candidate, alice)
        if ("GET", candidate) in OPERATION_SET:
            return alice.key, candidate
        candidate = candidate.rsplit("/", 1)[0]
    return None


OPERATION_SET = set(OPERATIONS)


def _snapshot(platform: SecurityPlatform, witness: tuple[str, str] | None) -> Any:
    if witness is None:
        return None
    got = platform.client(witness[0]).get(witness[1])
    try:
        return got.status_code, _stable(got.json())
    except ValueError:
        return got.status_code, got.text


def _keys_alive(platform: SecurityPlatform) -> dict[str, int]:
    keys = {"alice's spare key": platform.alice.spare_key, "the admin key": platform.admin_key,
            "the worker key": platform.worker_key}  # fmt: skip
    return {what: platform.client(key).get("/v1/whoami").status_code for what, key in keys.items()}


def _matches(status: int, expect: Expect) -> bool:
    return status in expect if isinstance(expect, frozenset) else status == expect


@pytest.mark.parametrize("cell", CELLS, ids=str)
def test_access(platform: SecurityPlatform, cell: Cell) -> None:
    request = plan(platform, cell)
    method = cell.method
    witness = _witness(platform, method, cell.path) if request.witness else None
    before = _snapshot(platform, witness)
    keys_before = _keys_alive(platform) if cell.path == "/v1/keys/{key_id}" else None
    kwargs: dict[str, Any] = {} if request.body is None else {"json": request.body}
    response = request.client.request(method, request.path, **kwargs)
    try:
        assert _matches(response.status_code, request.expect), (
            f"{cell}: {method} {request.path} answered {response.status_code}, the matrix "
            f"expects {request.expect}: {response.text[:600]}"
        )
        if request.check_leak and response.is_success:
            text = response.text
            leaked = [m for m in _markers(platform) if m in text]
            assert not leaked, f"{cell}: the answer carries alice's {leaked}: {text[:600]}"
        if cell.who == "default-tenant":
            ids = {item["id"] for item in response.json()["items"]}
            privileged = ids & {platform.admin_key_id, platform.worker_key_id}
            assert not privileged, f"{cell}: a tenant key sees privileged keys {privileged}"
        if witness is not None:
            after = _snapshot(platform, witness)
            assert after == before, (
                f"{cell}: alice's {witness[1]} changed under someone else's {method}:\n"
                f"before {before}\nafter  {after}"
            )
        if keys_before is not None:
            keys_after = _keys_alive(platform)
            if keys_after != keys_before:  # put them back for the rest of the package
                platform.unrevoke(platform.alice.spare_key_id, platform.admin_key_id,
                                  platform.worker_key_id)  # fmt: skip
            assert keys_after == keys_before, f"{cell}: a key was revoked: {keys_after}"
    finally:
        if request.cleanup is not None and response.is_success:
            owner = request.as_tenant or platform.alice
            undone = request.cleanup(request.client, owner, response)
            assert undone.status_code < 300, f"cleanup of {cell}: {undone.text[:300]}"


def test_the_served_document_is_the_one_the_matrix_covers(platform: SecurityPlatform) -> None:
    """The running API's ``/openapi.json`` (no key) has the operations the cells came from."""
    served = httpx.get(f"{platform.url}/openapi.json", timeout=30)
    assert served.status_code == 200
    got, want = set(operations(served.json())), set(OPERATIONS)
    assert got == want, f"served, not in the matrix: {got - want}; not served: {want - got}"


def test_every_route_is_documented_or_known_public() -> None:
    """A route left out of the document would be left out of the matrix."""
    from fastapi.routing import APIRoute
    from starlette.routing import Route

    app = _app()
    served: set[tuple[str, str]] = set()
    for route in app.routes:
        if isinstance(route, APIRoute | Route):
            served |= {(m, route.path) for m in route.methods or () if m != "HEAD"}
    missing = served - set(OPERATIONS) - UNDOCUMENTED
    assert not missing, f"routes outside the document and the matrix: {sorted(missing)}"


def test_the_document_says_which_routes_need_a_key() -> None:
    """Every route but the public ones declares the bearer key in the document."""
    wrong = []
    for method, path in OPERATIONS:
        operation = DOCUMENT["paths"][path][method.lower()]
        declared = bool(operation.get("security"))
        try:
            public = scopes_of(method, path) is None
        except Unplaced:
            continue  # its cell fails
        if declared == public:
            wrong.append(f"{method} {path}: {'declares' if declared else 'lacks'} a key")
    assert not wrong, wrong
