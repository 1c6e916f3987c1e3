"""OpenAI-compatible API under ``/openai/v1`` (apart from the control API's ``/v1``).

    GET  /openai/v1/models, /openai/v1/models/{model}
    POST /openai/v1/embeddings            embedding deployments (transformers, task embedding)
    POST /openai/v1/completions           LLM deployments (vllm), streaming included
    POST /openai/v1/chat/completions      LLM deployments (vllm), streaming included

``model`` names a deployment (or a model a deployment serves) or ``name:version``; the
API key is the bearer token. Embeddings go through ``Gateway.predict`` like ``:predict``.
Completions are passed through to a replica's own OpenAI routes (vLLM's serving layer)
chosen by the gateway's admission and router (``ember.serving.passthrough``); their bodies,
streamed server-sent events and ``usage`` are vLLM's, passed through untouched. Every answer
names the version that served it in ``X-Ember-Version`` (and embeddings in ``model``, as
``name:version``). Errors are RFC 9457 problems carrying OpenAI's
``{"error": {"message", "type", "code"}}`` member, with the status codes the ``openai``
client maps to its exceptions (a malformed request is 400, as OpenAI answers).

The routes only: the request and response models, the embeddings' encoding and the SSE
error framing are ``ember.api.protocols.openai``. Every route authenticates with
``PrincipalDep``, as every data-plane route does.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ember.api.deps import PrincipalDep
from ember.api.protocols import openai as protocol
from ember.api.protocols.common import ProtocolMismatch, requested_priority
from ember.api.protocols.openai import (
    EmbeddingRequest,
    EmbeddingResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
)
from ember.api.routes.predict import gateway_of, set_prediction_headers
from ember.domain.spec import VersionSpec
from ember.errors import MalformedRequest, NotFound, NotReady
from ember.registry.tenants import Principal
from ember.serving.gateway import Gateway, Prediction
from ember.serving.passthrough import Opened, Passthrough
from ember.serving.routing import DeploymentView
from ember.web.bodies import M, parse_object
from ember.web.problems import DATA_PLANE_RESPONSES, problem_responses

router = APIRouter(
    prefix="/openai/v1",
    tags=["openai"],
    responses={**DATA_PLANE_RESPONSES, **problem_responses((400, "Malformed request"))},
)
PriorityHeader = Annotated[
    str | None, Header(max_length=16, description="online (default) | async | batch")
]
SessionHeader = Annotated[str | None, Header(max_length=256)]


async def _body(request: Request, schema: type[M]) -> tuple[M, dict[str, Any]]:
    return parse_object(await request.body(), schema, "the request")


def _target(gateway: Gateway, tenant_id: int, model: str) -> tuple[DeploymentView, str | None]:
    """``deployment`` or ``deployment:version`` → the deployment and the pinned version."""
    name, sep, version = model.partition(":")
    if not name or (sep and not version):
        raise MalformedRequest(f"model {model!r} must be a deployment or name:version")
    view = gateway.deployment_named(tenant_id, name)
    if version and version not in view.specs:
        raise NotFound(f"model {model!r} does not exist: version {version!r} is not served")
    return view, version or None


def _spec(view: DeploymentView, version: str | None) -> VersionSpec:
    chosen = version or view.production or min(view.specs, default=None)
    if chosen is None:
        raise NotReady(f"deployment {view.name!r} serves no ready version yet")
    return view.specs[chosen]


def _headers(response: Response, view: DeploymentView, opened: Opened) -> None:
    served = Prediction(
        {}, opened.version, opened.replica_id, view.name, opened.attempts, cache="off"
    )
    set_prediction_headers(response, served)


class _Relay(StreamingResponse):
    """Streams a replica's answer; releases the replica however the stream ends (also
    when the client leaves before the first byte)."""

    def __init__(self, opened: Opened) -> None:
        super().__init__(opened.stream(protocol.sse_error), media_type=opened.media_type)
        self.opened = opened

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.opened.close()


# --- routes ------------------------------------------------------------------------------


def _cards(gateway: Gateway, tenant_id: int, owner: str) -> list[ModelCard]:
    created = int(time.time())
    cards = []
    for (tenant, name), view in sorted(gateway.control.deployments.items()):
        if tenant != tenant_id:
            continue
        for model in (name, *(f"{name}:{v}" for v in sorted(view.specs))):
            cards.append(ModelCard(id=model, created=created, owned_by=owner))
    return cards


@router.get("/models", summary="Deployments and their served versions, as OpenAI models")
def list_models(request: Request, principal: PrincipalDep) -> ModelList:
    return ModelList(data=_cards(gateway_of(request), principal.tenant_id, principal.tenant))


@router.get("/models/{model}", summary="One model (deployment or name:version)")
def get_model(
    model: Annotated[str, Path(max_length=200)], request: Request, principal: PrincipalDep
) -> ModelCard:
    cards = _cards(gateway_of(request), principal.tenant_id, principal.tenant)
    for card in cards:
        if card.id == model:
            return card
    raise NotFound(f"model {model!r} does not exist")


EMBEDDINGS_DOC = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": EmbeddingRequest.model_json_schema()}}}}  # fmt: skip


@router.post(
    "/embeddings",
    summary="Embeddings from an embedding deployment",
    openapi_extra=EMBEDDINGS_DOC,
    response_model=EmbeddingResponse,
)
async def embeddings(
    request: Request,
    response: Response,
    principal: PrincipalDep,
    x_ember_priority: PriorityHeader = None,
    x_ember_session: SessionHeader = None,
) -> EmbeddingResponse:
    gateway = gateway_of(request)
    body, _ = await _body(request, EmbeddingRequest)
    view, version = _target(gateway, principal.tenant_id, body.model)
    spec = _spec(view, version)
    if spec.engine != "transformers" or spec.engine_config.get("task", "embedding") != "embedding":
        raise ProtocolMismatch(f"model {body.model!r} ({spec.engine}) is not an "
                               "embedding model", engine=spec.engine)  # fmt: skip
    texts = protocol.embedding_texts(body)
    priority = requested_priority(x_ember_priority)
    timeout_ms = float(view.policy.timeout_ms)
    result = await gateway.predict(
        view, principal.tenant, texts, priority, timeout_ms, x_ember_session, version
    )
    set_prediction_headers(response, result)
    served = f"{view.name}:{result.version}"
    return protocol.embedding_response(body, result.body["predictions"], served)


GENERATION_DOC = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": GenerationRequest.model_json_schema()}}}}  # fmt: skip
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "vLLM's answer: JSON, or server-sent events with `stream: true`.",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    },
}


async def _generate(
    request: Request,
    principal: Principal,
    path: str,
    text_field: str,
    priority_header: str | None,
    session_key: str | None,
) -> Response:
    gateway = gateway_of(request)
    body, document = await _body(request, GenerationRequest)
    view, version = _target(gateway, principal.tenant_id, body.model)
    spec = _spec(view, version)
    if spec.engine != "vllm":
        raise ProtocolMismatch(f"model {body.model!r} ({spec.engine}) does not "
                               "generate text", engine=spec.engine)  # fmt: skip
    opened = await Passthrough(gateway).open(
        view,
        principal.tenant,
        path,
        lambda chosen: document | {"model": f"{view.name}:{chosen}"},
        priority=requested_priority(priority_header),
        timeout_ms=float(view.policy.timeout_ms),
        input_size=protocol.text_size(document.get(text_field)) / 4 + 1,
        output_size=body.completion_tokens(),
        session_key=session_key,
        version=version,
    )
    if opened.status == 200 and body.stream:
        relay = _Relay(opened)
        _headers(relay, view, opened)
        return relay
    content = await opened.body()
    answer = Response(content, status_code=opened.status, media_type=opened.media_type)
    if opened.status == 200:
        _headers(answer, view, opened)
    if opened.status != 200 and not protocol.openai_shaped(content):
        answer = Response(protocol.error_body(content, opened.status),
                          status_code=opened.status, media_type="application/json")  # fmt: skip
    retry_after = opened.response.headers.get("retry-after")
    if retry_after:
        answer.headers["Retry-After"] = retry_after
    return answer


@router.post(
    "/completions",
    summary="Text completions from an LLM deployment (streaming with `stream: true`)",
    openapi_extra=GENERATION_DOC,
    responses=GENERATION_RESPONSES,
    response_model=None,
)
async def completions(
    request: Request,
    principal: PrincipalDep,
    x_ember_priority: PriorityHeader = None,
    x_ember_session: SessionHeader = None,
) -> Response:
    return await _generate(request, principal, "/v1/completions", "prompt",
                           x_ember_priority, x_ember_session)  # fmt: skip


@router.post(
    "/chat/completions",
    summary="Chat completions from an LLM deployment (streaming with `stream: true`)",
    openapi_extra=GENERATION_DOC,
    responses=GENERATION_RESPONSES,
    response_model=None,
)
async def chat_completions(
    request: Request,
    principal: PrincipalDep,
    x_ember_priority: PriorityHeader = None,
    x_ember_session: SessionHeader = None,
) -> Response:
    return await _generate(request, principal, "/v1/chat/completions", "messages",
                           x_ember_priority, x_ember_session)  # fmt: skip
