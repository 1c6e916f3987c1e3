"""The replica's internal HTTP API (loopback by default; the pools controller and the
gateway call it, clients never do).

``POST /infer`` takes JSON (``{"instances": [...], "priority", "timeout_ms"}``) or a
tensor body (``Content-Type: application/x-ember-tensor; dtype=...; shape=N,...``, the
instances' bytes; ``X-Ember-Priority`` and ``X-Ember-Timeout-Ms`` headers): the batch
lane's form, read with ``np.frombuffer`` into one array that the engine checks whole.
Either way the answer is ``{"predictions": [...], "model", "version"}``.

Every route but the probes (``/healthz``, ``/readyz``) needs the replica's secret in
``X-Ember-Replica-Secret`` (``ReplicaApp``): the lean lane, the control routes and an
engine's own routes (vLLM's OpenAI API, mounted once assigned) alike."""

from __future__ import annotations

import asyncio
import hmac
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated, Any

import pydantic_core
from fastapi import APIRouter, FastAPI, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request as StarletteRequest
from starlette.types import Receive, Scope, Send

from ember import tracing
from ember.domain.spec import REPLICA_SECRET_HEADER, Priority, Tier, VersionSpec
from ember.engine.metrics import serve_replica_metrics
from ember.engine.replica import Replica, Tenancy
from ember.errors import InvalidInput, Unauthenticated
from ember.logs import get_logger
from ember.web import problems
from ember.web.lane import Answer, LaneApp, header_values
from ember.web.middleware import BodyLimit, RequestContext
from ember.web.tensorbody import (
    TIMEOUT_HEADER,
    TensorBody,
    answer_body,
    is_tensor,
    timeout_header,
)
from ember.web.tensorbody import parse as parse_tensor

log = get_logger(__name__)


MAX_INSTANCES = 100_000
MAX_TIMEOUT_MS = 3_600_000.0


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instances: list[Any] = Field(min_length=1, max_length=MAX_INSTANCES)
    priority: str = "online"
    timeout_ms: float | None = Field(None, gt=0, le=MAX_TIMEOUT_MS)


class TierRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tier: Tier


class AssignParams(BaseModel):
    """How an assigned standby process serves: its deployment's batch policy and threads
    (query parameters of ``POST /assign``; the body is the VersionSpec)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int | None = Field(None, ge=1, le=4096)
    max_queue_delay_ms: float | None = Field(None, ge=0, le=10_000)
    max_queue: int | None = Field(None, ge=1)
    threads: int | None = Field(None, ge=1, le=1024)
    tenant_id: int | None = Field(None, ge=0)
    """Whose version: the replica uses the tenant's cache directory and home."""
    uid: int | None = Field(None, ge=1)
    """Drop to this uid (and ``gid``) before reading the version (a root standby process)."""
    gid: int | None = Field(None, ge=1)


OPEN_PATHS = frozenset({"/healthz", "/readyz"})
"""The probes: served without the secret (a kubelet or the controller's idle probe)."""
_SECRET_HEADER = REPLICA_SECRET_HEADER.lower().encode("latin-1")


class ReplicaApp(LaneApp):
    """The replica's app: in front of everything (lanes, middleware, routes mounted later),
    a request to any path but ``OPEN_PATHS`` must carry ``secret`` (``None``: no check)."""

    secret: bytes | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        secret = self.secret
        if secret is not None and scope["type"] != "lifespan" and scope["path"] not in OPEN_PATHS:
            given = b""
            for key, value in scope["headers"]:
                if key == _SECRET_HEADER:
                    given = value
                    break
            if not hmac.compare_digest(given, secret):
                await _refuse(scope, send)
                return
        await super().__call__(scope, receive, send)


async def _refuse(scope: Scope, send: Send) -> None:
    """A 401 problem that says only what is missing (a websocket is closed unaccepted)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    exc = Unauthenticated("this replica's API needs its secret")
    response = await problems.ember_error_response(StarletteRequest(scope), exc)
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})  # fmt: skip
    await send({"type": "http.response.body", "body": response.body})


TIMING_PARTS = (("queue", "busy_s"), ("batch", "window_s"), ("handoff", "handoff_s"),
                ("forward", "forward_s"))  # fmt: skip
"""``Server-Timing`` metric names of the scheduler's ``timing`` entries."""


def server_timing(timing: dict[str, float], replica_ms: str) -> str:
    """The replica's ``Server-Timing`` value (W3C): ``queue`` (waiting while earlier batches
    computed), ``batch`` (waiting for the batch window), ``handoff`` (to and from the
    compute thread), ``forward`` (the batch's forward pass) — for the request's instance
    whose forward pass ended last — and ``replica``, its whole time (``X-Ember-Replica-Ms``);
    what ``replica`` holds beyond the others is reading the body and building the answer."""
    parts = [f"{name};dur={timing[key] * 1000:.3f}" for name, key in TIMING_PARTS if key in timing]
    return ", ".join([*parts, f"replica;dur={replica_ms}"])


def create_replica_app(
    replica: Replica, spec: VersionSpec | None, secret: str | None = None
) -> FastAPI:
    """The replica's API; ``secret``: what every call but the probes must carry (None: a
    replica started by hand on loopback, unauthenticated). ``spec``: the version to load
    at startup (None: a standby process, given one later by ``POST /assign``)."""
    app = ReplicaApp(title="Ember replica", lifespan=_lifespan(replica, spec), openapi_url=None)
    app.secret = secret.encode("latin-1") if secret else None
    app.state.replica = replica
    problems.install(app)
    inference = Inference(replica)
    app.include_router(inference.router())
    max_bytes = replica.settings.max_request_bytes
    app.add_lane(re.compile("/infer"), inference.lean, max_bytes=max_bytes, media=None)
    app.add_middleware(BodyLimit, max_bytes=max_bytes)
    app.add_middleware(RequestContext)
    app.include_router(probe_routes(replica))
    app.include_router(control_routes(replica))
    return app


async def assign_and_mount(
    app: FastAPI, replica: Replica, version: VersionSpec, params: AssignParams | None = None
) -> None:
    """Load ``version`` (with its deployment's batch policy, threads and tenancy), then
    mount the engine's own routes (vLLM's OpenAI API) on ``app`` if it has any."""
    params = params or AssignParams()
    policy = params.model_dump(exclude_none=True, exclude={"threads", "tenant_id", "uid", "gid"})
    tenant = None
    if params.tenant_id is not None:
        tenant = Tenancy(params.tenant_id, params.uid, params.gid)
    await replica.assign(version, policy, params.threads, tenant)
    router = replica.engine.routes() if replica.engine and replica.state == "ready" else None
    if router is not None:
        app.include_router(router)


def _lifespan(
    replica: Replica, spec: VersionSpec | None
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Tracing, the version's load (in the background: the probes answer meanwhile) and
    the engine's metrics port for the app's life; the replica is closed at its end."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        traced = tracing.setup(replica.settings, "ember-engine")  # EMBER_OTEL_ENDPOINT
        loading = None
        if spec is not None:
            loading = asyncio.create_task(assign_and_mount(app, replica, spec))
        scraped = await serve_replica_metrics(replica, replica.settings.engine_metrics_port)
        try:
            yield
        finally:
            if scraped is not None:
                await scraped.close()
            if loading is not None and not loading.done():
                loading.cancel()
            await replica.close()
            if traced:
                tracing.shutdown()

    return lifespan


def replica_headers(replica: Replica) -> dict[str, str]:
    """Which replica answered, and with which version once it has one."""
    s = replica.spec
    base = {"X-Ember-Replica": replica.replica_id}
    return base | ({"X-Ember-Model": s.model, "X-Ember-Version": s.version} if s else {})


class Inference:
    """``POST /infer``: the route (``router``) and the lean lane (``lean``), which share
    ``answer``."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    async def answer(
        self,
        body: InferRequest | TensorBody,
        priority_header: str | None,
        timeout_ms: float | None,
        began: float,
    ) -> tuple[Any, dict[str, str]]:
        """The answer to ``/infer`` and its headers. ``X-Ember-Queue-Ms``: time queued
        for a batch; ``X-Ember-Replica-Ms``: time from the request's body read
        (``began``, ``perf_counter``) to the answer built, so a caller can tell the
        replica's time from everything around it; ``Server-Timing``: that time's parts
        (``server_timing``)."""
        replica = self.replica
        try:
            default = "online" if isinstance(body, TensorBody) else body.priority
            priority = Priority.parse(priority_header or default)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        if priority is Priority.health:
            raise InvalidInput("the health class is reserved for probes")
        timing: dict[str, float] = {}
        if isinstance(body, TensorBody):
            outputs = await replica.infer_tensor(body.array(), priority, timeout_ms, timing)
        else:
            outputs = await replica.infer(body.instances, priority, body.timeout_ms, timing)
        assert replica.spec is not None
        if tracing.enabled:  # the replica's spans: its queue, batch window, forward pass
            spec = replica.spec
            tracing.annotate(tracing.model_attributes(spec.model, spec.version,
                                                      replica=replica.replica_id))  # fmt: skip
            tracing.record_stages(timing)
        answer = {"predictions": outputs, "model": replica.spec.model,
                  "version": replica.spec.version}  # fmt: skip
        queue_ms = f"{timing.get('queue_s', 0.0) * 1000:.3f}"
        replica_ms = f"{(time.perf_counter() - began) * 1000:.3f}"
        return answer, replica_headers(replica) | {
            "X-Ember-Queue-Ms": queue_ms,
            "X-Ember-Replica-Ms": replica_ms,
            "Server-Timing": server_timing(timing, replica_ms),
        }

    def router(self) -> APIRouter:
        """The route, for what the lean lane leaves to it (a JSON body that does not
        validate: FastAPI says why)."""
        router = APIRouter()

        @router.post("/infer")
        async def infer(
            body: InferRequest, response: Response,
            x_ember_priority: Annotated[str | None, Header()] = None,
        ) -> dict[str, Any]:  # fmt: skip
            answer, extra = await self.answer(body, x_ember_priority, None, time.perf_counter())
            response.headers.update(extra)
            return dict(answer)

        return router

    async def lean(self, scope: Scope, match: re.Match[str], raw: bytes) -> Answer | None:
        """``/infer`` without FastAPI's routing and validation (the gateway's every hop);
        a JSON body that does not validate is left to the route, which says why. A tensor
        body (``ember.web.tensorbody``) is only ever served here, errors included."""
        began = time.perf_counter()
        ctype, priority, timeout, accept = header_values(
            scope, b"content-type", b"x-ember-priority", TIMEOUT_HEADER.encode(), b"accept"
        )
        body: InferRequest | TensorBody
        timeout_ms = None
        if is_tensor(ctype):
            assert ctype is not None
            body = parse_tensor(ctype, raw, MAX_INSTANCES)
            timeout_ms = timeout_header(timeout, MAX_TIMEOUT_MS)
        else:
            try:
                body = InferRequest.model_validate_json(raw)
            except ValueError:
                return None
        answer, extra = await self.answer(body, priority, timeout_ms, began)
        names = [(k.lower().encode(), v.encode("latin-1")) for k, v in extra.items()]
        if is_tensor(accept):  # the batch lane: no float-by-float encoding either way
            tensor = answer_body(answer["predictions"])
            if tensor is not None:
                return Answer(tensor.data, names, media_type=tensor.content_type.encode())
        # pydantic's encoder, as FastAPI's for the route (NaN as null): ~6x json.dumps here
        return Answer(pydantic_core.to_json(answer, inf_nan_mode="null"), names)


def probe_routes(replica: Replica) -> APIRouter:
    """Liveness, readiness (the only routes served without the secret) and metrics."""
    router = APIRouter()

    @router.get("/healthz")
    async def healthz() -> JSONResponse:
        """Black-box liveness: a real forward pass when hot, at the highest priority."""
        if replica.state == "failed":
            return JSONResponse({"status": "failed", "reason": replica.failure}, 503)
        if replica.state == "ready":  # standby and loading are alive without a model
            await replica.probe()
        return JSONResponse({"status": "ok", "state": replica.state, "tier": replica.tier.value},
                            headers=replica_headers(replica))  # fmt: skip

    @router.get("/readyz")
    async def readyz() -> JSONResponse:
        ready = replica.state == "ready" and replica.tier is Tier.hot
        body = {"ready": ready, "state": replica.state, "tier": replica.tier.value}
        return JSONResponse(body, 200 if ready else 503, headers=replica_headers(replica))

    @router.get("/metrics")
    async def metrics() -> Response:
        data = replica.metrics.render() if replica.metrics else b""
        if replica.engine is not None:
            data += replica.engine.metrics_text()
        return Response(data, media_type="text/plain; version=0.0.4")

    return router


def control_routes(replica: Replica) -> APIRouter:
    """What the pools controller drives: the tier, a standby's assignment, the info."""
    router = APIRouter()

    @router.post("/tier")
    async def tier(body: TierRequest) -> dict[str, Any]:
        await replica.set_tier(body.tier)
        return replica.info()

    @router.post("/assign")
    async def assign(
        body: VersionSpec, request: Request, params: Annotated[AssignParams, Query()]
    ) -> JSONResponse:
        """Give a standby process its version (and, in the query, its deployment's batch
        policy and threads); answers once it is loaded (or failed)."""
        await assign_and_mount(request.app, replica, body, params)
        status = 200 if replica.state == "ready" else 503
        return JSONResponse(replica.info(), status)

    @router.get("/info")
    async def info() -> dict[str, Any]:
        return replica.info()

    return router
