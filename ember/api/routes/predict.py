"""Online predict (KServe V1 / TF Serving body, or a tensor body) and a deployment's replicas."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Header, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Scope

from ember.api.deps import (
    ControlPlane,
    PrincipalDep,
    SessionDep,
    authenticate_key,
    bearer_key,
    cached_principal,
)
from ember.domain.spec import Priority
from ember.errors import InvalidInput, NotReady
from ember.registry import deployments
from ember.registry.schemas import NAME_PATTERN, VERSION_PATTERN
from ember.registry.tenants import Principal
from ember.serving.gateway import Gateway, Instances, Prediction
from ember.web.lane import Answer, header_values
from ember.web.problems import DATA_PLANE_RESPONSES
from ember.web.tensorbody import TIMEOUT_HEADER, is_tensor, timeout_header
from ember.web.tensorbody import parse as parse_tensor

if TYPE_CHECKING:
    from ember.pools.controller import PoolsController

router = APIRouter(tags=["predict"], responses=DATA_PLANE_RESPONSES)
ModelName = Annotated[str, Path(pattern=NAME_PATTERN, description="Model name.")]
VersionRef = Annotated[str, Path(pattern=VERSION_PATTERN, description="Version.")]
SESSION_MAX = 256
TENANT_MAX = 63
MAX_INSTANCES = 10_000
MAX_TIMEOUT_MS = 600_000.0


class PredictRequest(BaseModel):
    """``{"instances": [...]}`` → ``{"predictions": [...]}`` (KServe V1, TF Serving).

    The lean lane also takes the same instances as a tensor body
    (``Content-Type: application/x-ember-tensor; dtype=float32; shape=N,...``, see
    ``ember.web.tensorbody``), as the batch lane's workers send them."""

    model_config = ConfigDict(extra="forbid")

    instances: list[Any] = Field(min_length=1, max_length=MAX_INSTANCES)
    timeout_ms: float | None = Field(None, gt=0, le=MAX_TIMEOUT_MS, description="Deadline.")
    priority: str = Field("online", description="online | async | batch")


class PredictResponse(BaseModel):
    predictions: list[Any]
    model: str
    version: str


def prediction_headers(result: Prediction) -> list[tuple[str, str]]:
    """Which deployment, version, replica and ladder rung served an answer, and the
    replica's own time for it (``x-ember-replica-ms``; the rest of the latency is Ember's
    gateway and the network; ``server-timing``: the gateway's and the replica's parts, see
    ``Prediction.timing``)."""
    timing = [] if result.replica_ms is None else [("x-ember-replica-ms", result.replica_ms)]
    if result.timing is not None:
        timing.append(("server-timing", result.timing))
    return [
        *timing,
        ("x-ember-deployment", result.deployment),
        ("x-ember-version", result.version),
        ("x-ember-replica", result.replica_id),
        ("x-ember-attempts", str(result.attempts)),
        ("x-ember-rung", result.rung),
        ("x-ember-cache", result.cache),
    ]


def set_prediction_headers(response: Response, result: Prediction) -> None:
    """Every data-plane answer says which deployment, version, replica and ladder rung
    served it (every protocol route calls this)."""
    for name, value in prediction_headers(result):
        response.headers[name] = value


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway | None = getattr(request.app.state, "gateway", None)
    if gateway is None:
        raise NotReady("this API process runs no pools controller (EMBER_POOLS_ENABLED=false)")
    return gateway


async def serve(
    gateway: Gateway,
    principal: Principal,
    name: str,
    instances: Instances,
    priority_text: str,
    timeout_ms: float | None,
    version: str | None,
    session_key: str | None,
) -> tuple[Prediction, bytes]:
    """The prediction and the answer's JSON bytes: the replica's (or the cache's) as they
    came when there are such bytes, never decoded and re-encoded."""
    try:
        priority = Priority.requested(priority_text)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc
    view = gateway.deployment_for(principal.tenant_id, name)
    timeout_ms = timeout_ms or float(view.policy.timeout_ms)
    result = await gateway.predict(
        view, principal.tenant, instances, priority, timeout_ms, session_key, version
    )
    if result.content is not None:
        return result, result.content
    answer = PredictResponse(
        predictions=result.body["predictions"], model=view.model, version=result.version
    )
    return result, answer.model_dump_json().encode()


async def _predict(
    request: Request,
    principal: Principal,
    name: str,
    body: PredictRequest,
    version: str | None,
    session_key: str | None,
) -> Response:
    result, content = await serve(
        gateway_of(request), principal, name, body.instances, body.priority, body.timeout_ms,
        version, session_key,
    )  # fmt: skip
    answer = Response(content, media_type="application/json")
    set_prediction_headers(answer, result)
    return answer


#: Both predict paths, for the lean lane (``{name}`` / ``{version}`` as Starlette matches
#: them; the lane checks the patterns and leaves anything else to the routes).
PREDICT_PATH = re.compile(r"/v1/models/(?P<name>[^/]+?)(?:/versions/(?P<version>[^/]+))?:predict")
_NAME = re.compile(NAME_PATTERN)
_VERSION = re.compile(VERSION_PATTERN)


async def lean_predict(scope: Scope, match: re.Match[str], raw: bytes) -> Answer | None:
    """``:predict`` without FastAPI's routing, dependencies and validation: for a known
    key (the principal cache) and a body that validates; None leaves anything else —
    malformed input, an unknown key — to the routes below, which answer it as always."""
    gateway: Gateway | None = getattr(scope["app"].state, "gateway", None)
    name, version = match["name"], match["version"]
    if (
        gateway is None
        or not _NAME.fullmatch(name)
        or (version is not None and not _VERSION.fullmatch(version))
    ):
        return None
    authorization, tenant, session_key, ctype = header_values(
        scope, b"authorization", b"x-ember-tenant", b"x-ember-session", b"content-type"
    )
    if is_tensor(ctype):
        assert ctype is not None
        return await tensor_predict(
            scope, gateway, name, version, raw, ctype, authorization, tenant, session_key
        )
    state = scope["app"].state
    principal = cached_principal(state.principals, authorization, tenant, state.engine)
    if principal is None or (session_key is not None and len(session_key) > SESSION_MAX):
        return None
    try:
        body = PredictRequest.model_validate_json(raw)
    except ValueError:
        return None
    result, content = await serve(
        gateway, principal, name, body.instances, body.priority, body.timeout_ms, version,
        session_key,
    )  # fmt: skip
    headers = [(k.encode(), v.encode("latin-1")) for k, v in prediction_headers(result)]
    if body.priority == "batch":
        headers.append(batch_window(gateway, principal, name, result))
    return Answer(content, headers)


def batch_window(
    gateway: Gateway, principal: Principal, name: str, result: Prediction
) -> tuple[bytes, bytes]:
    """``X-Ember-Batch-Window``: the instances the batch class may have in flight to the
    version that answered (a batch worker keeps that many going)."""
    view = gateway.deployment_for(principal.tenant_id, name)
    return (b"x-ember-batch-window", str(gateway.batch_window(view, result.version)).encode())


async def tensor_predict(
    scope: Scope,
    gateway: Gateway,
    name: str,
    version: str | None,
    raw: bytes,
    ctype: str,
    authorization: str | None,
    tenant: str | None,
    session_key: str | None,
) -> Answer:
    """``:predict`` with a tensor body (``ember.web.tensorbody``: the batch lane's
    form; priority and deadline in ``X-Ember-Priority`` / ``X-Ember-Timeout-Ms``). Served
    here whole, errors included (the JSON route cannot read it); the bytes go on to the
    replica as they came. A batch-class answer says in ``X-Ember-Batch-Window`` how many
    instances the class may have in flight to this version now."""
    if tenant is not None and len(tenant) > TENANT_MAX:
        raise InvalidInput(f"X-Ember-Tenant is longer than {TENANT_MAX} characters")
    if session_key is not None and len(session_key) > SESSION_MAX:
        raise InvalidInput(f"X-Ember-Session is longer than {SESSION_MAX} characters")
    # PrincipalDep's own authentication (FastAPI's dependencies never see this path)
    principal = await authenticate_key(scope["app"].state, bearer_key(authorization), tenant)
    priority, timeout = header_values(scope, b"x-ember-priority", TIMEOUT_HEADER.encode())
    body = parse_tensor(ctype, raw, MAX_INSTANCES)
    timeout_ms = timeout_header(timeout, MAX_TIMEOUT_MS)
    result, content = await serve(
        gateway, principal, name, body, priority or "online", timeout_ms, version, session_key
    )
    headers = [(k.encode(), v.encode("latin-1")) for k, v in prediction_headers(result)]
    if priority == "batch":
        headers.append(batch_window(gateway, principal, name, result))
    return Answer(content, headers)


@router.post(
    "/v1/models/{name}:predict",
    summary="Predict with the deployed version(s)",
    response_model=PredictResponse,
)
async def predict(
    name: ModelName,
    body: PredictRequest,
    request: Request,
    principal: PrincipalDep,
    x_ember_session: Annotated[str | None, Header(max_length=SESSION_MAX)] = None,
) -> Response:
    """Routed by the deployment's traffic weights (canary); `X-Ember-Session` keeps a
    session on one replica while it is not overloaded."""
    return await _predict(request, principal, name, body, None, x_ember_session)


@router.post(
    "/v1/models/{name}/versions/{version}:predict",
    summary="Predict with one version",
    response_model=PredictResponse,
)
async def predict_version(
    name: ModelName,
    version: VersionRef,
    body: PredictRequest,
    request: Request,
    principal: PrincipalDep,
    x_ember_session: Annotated[str | None, Header(max_length=SESSION_MAX)] = None,
) -> Response:
    return await _predict(request, principal, name, body, version, x_ember_session)


class LaneRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sent: int = Field(
        0, ge=0, le=10**12, description="Instances sent to the replicas directly since the "
        "last call (reported as demand)."
    )  # fmt: skip


class LaneReplica(BaseModel):
    id: str
    url: str
    secret: str = Field(description="The replica API's secret (X-Ember-Replica-Secret).")
    window: int = Field(description="Instances the batch class may keep in flight to it.")


class LaneResponse(BaseModel):
    model: str
    deployment: str
    version: str
    max_batch_size: int
    refresh_s: float = Field(description="Ask again after this long.")
    replicas: list[LaneReplica]


@router.post(
    "/v1/models/{name}/versions/{version}:batch-lane",
    summary="Where batch workers send one version's batches",
    response_model=LaneResponse,
)
def batch_lane(
    name: ModelName,
    version: VersionRef,
    body: LaneRequest,
    request: Request,
    principal: PrincipalDep,
) -> dict[str, Any]:
    """The batch lane's direct route: the version's ready replicas and the batch class's
    window on each. A batch worker posts its batches (tensor bodies, ``X-Ember-Priority:
    batch``) to their ``/infer`` itself, so the gateway neither carries nor re-encodes
    them; replicas still serve online traffic first. ``sent`` reports what it sent that
    way since its last call, as demand for the autoscaler. An empty list: no replica is
    ready yet (one is asked for); send through ``:predict`` meanwhile. Admin and worker
    keys only: it names replicas, and ``sent`` counts as admitted demand."""
    principal.require_worker_or_admin()
    gateway = gateway_of(request)
    view = gateway.deployment_for(principal.tenant_id, name)
    return gateway.batch_lane(view, version, body.sent)


@router.get(
    "/v1/deployments/{name}/replicas",
    summary="A deployment's replicas",
    dependencies=[ControlPlane],
)
def replicas(
    name: Annotated[str, Path(pattern=NAME_PATTERN)],
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
) -> dict[str, Any]:
    deployment = deployments.get(session, principal.tenant_id, name)
    gateway_of(request)  # the problem where pools are off
    pools: PoolsController = request.app.state.pools  # the control side's own view
    key = (deployment.tenant_id, deployment.name)
    events = [e for e in pools.events if (e["tenant_id"], e["deployment"]) == key]
    return {"deployment": name, "replicas": pools.replicas_of(key), "events": events}
