"""OpenAI-compatible API under ``/openai/v1`` (apart from the control API's ``/v1``).

    GET  /openai/v1/models, /openai/v1/models/{model}
    POST /openai/v1/embeddings            embedding deployments (transformers, task embedding)
    POST /openai/v1/completions           LLM deployments (vllm), streaming included
    POST /openai/v1/chat/completions      LLM deployments (vllm), streaming included

``model`` names a deployment (or a model a deployment serves) or ``name:version``; the
API key is the bearer token. Embeddings go through ``Gateway.predict`` like ``:predict``.
Completions are passed through to a replica's own OpenAI routes (vLLM's serving layer)
chosen by the gateway's admission and router (``ember.pools.passthrough``); their bodies,
streamed server-sent events and ``usage`` are vLLM's, passed through untouched. Every answer
names the version that served it in ``X-Ember-Version`` (and embeddings in ``model``, as
``name:version``). Errors are RFC 9457 problems carrying OpenAI's
``{"error": {"message", "type", "code"}}`` member, with the status codes the ``openai``
client maps to its exceptions (a malformed request is 400, as OpenAI answers).
"""

from __future__ import annotations

import base64
import json
import time
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Header, Path, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Receive, Scope, Send

from ember.api.bodies import M, parse_object
from ember.api.deps import PrincipalDep
from ember.api.problems import DATA_PLANE_RESPONSES, problem_responses
from ember.api.routes.predict import gateway_of, set_prediction_headers
from ember.api.routes.v2 import ProtocolMismatch
from ember.engine.spec import Priority
from ember.errors import EngineError, MalformedRequest, NotFound, NotReady
from ember.pools.controller import DeploymentView
from ember.pools.gateway import Gateway, Prediction
from ember.pools.passthrough import Opened, Passthrough

router = APIRouter(
    prefix="/openai/v1",
    tags=["openai"],
    responses={**DATA_PLANE_RESPONSES, **problem_responses((400, "Malformed request"))},
)
PriorityHeader = Annotated[
    str | None, Header(max_length=16, description="online (default) | async | batch")
]
SessionHeader = Annotated[str | None, Header(max_length=256)]
MAX_EMBEDDING_INPUTS = 2048
#: Completion length assumed for admission when the request does not say (vLLM's default).
DEFAULT_MAX_TOKENS = 16


# --- wire schemas ------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = Field(None, max_length=256)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class GenerationRequest(BaseModel):
    """What Ember reads of a completion request; every other field goes to vLLM as sent."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=200)
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


# --- helpers -----------------------------------------------------------------------------


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


def _spec(view: DeploymentView, version: str | None) -> dict[str, Any]:
    chosen = version or view.production or min(view.specs, default=None)
    if chosen is None:
        raise NotReady(f"deployment {view.name!r} serves no ready version yet")
    return view.specs[chosen]


def _priority(header: str | None) -> Priority:
    try:
        return Priority.requested(header)
    except ValueError as exc:
        raise MalformedRequest(str(exc)) from None


def _text_size(value: Any, depth: int = 0) -> int:
    """Characters of text in a prompt or messages (for a token estimate)."""
    if isinstance(value, str):
        return len(value)
    if depth > 8:
        return 0
    if isinstance(value, list):
        return sum(_text_size(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return sum(_text_size(v, depth + 1) for v in value.values())
    return 1 if isinstance(value, int) else 0  # token ids count one each


def _headers(response: Response, view: DeploymentView, opened: Opened) -> None:
    served = Prediction(
        {}, opened.version, opened.replica_id, view.name, opened.attempts, cache="off"
    )
    set_prediction_headers(response, served)


def _sse_error(message: str) -> bytes:
    """An SSE event the ``openai`` client raises as an ``APIError``."""
    error = {"message": message, "type": "server_error", "param": None, "code": "engine-error"}
    return f"data: {json.dumps({'error': error})}\n\n".encode()


class _Relay(StreamingResponse):
    """Streams a replica's answer; releases the replica however the stream ends (also
    when the client leaves before the first byte)."""

    def __init__(self, opened: Opened) -> None:
        super().__init__(opened.stream(_sse_error), media_type=opened.media_type)
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
    for (tenant, name), view in sorted(gateway.controller.deployments.items()):
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
    task = (spec.get("engine_config") or {}).get("task", "embedding")
    if spec.get("engine") != "transformers" or task != "embedding":
        raise ProtocolMismatch(f"model {body.model!r} ({spec.get('engine')}) is not an "
                               "embedding model", engine=spec.get("engine"))  # fmt: skip
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise MalformedRequest("input must not be empty")
    if not all(isinstance(t, str) for t in texts):
        raise MalformedRequest("input must be text: token arrays are not supported")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise MalformedRequest(f"input has {len(texts)} items; at most {MAX_EMBEDDING_INPUTS}")
    priority = _priority(x_ember_priority)
    timeout_ms = float(view.policy.timeout_ms)
    result = await gateway.predict(
        view, principal.tenant, list(texts), priority, timeout_ms, x_ember_session, version
    )
    set_prediction_headers(response, result)
    vectors = result.body["predictions"]
    data = []
    for index, vector in enumerate(vectors):
        if not isinstance(vector, list) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in vector
        ):
            raise EngineError(f"{body.model!r} answered something that is not an embedding")
        if body.dimensions is not None and body.dimensions != len(vector):
            raise MalformedRequest(
                f"dimensions {body.dimensions} is not supported: {body.model!r} gives "
                f"{len(vector)}-dimensional embeddings"
            )
        if body.encoding_format == "base64":
            raw = np.asarray(vector, dtype="<f4").tobytes()
            data.append(Embedding(index=index, embedding=base64.b64encode(raw).decode()))
        else:
            data.append(Embedding(index=index, embedding=vector))
    # The replica does not report token counts for embeddings yet: usage reads zero.
    usage = EmbeddingUsage(prompt_tokens=0, total_tokens=0)
    served = f"{view.name}:{result.version}"
    return EmbeddingResponse(data=data, model=served, usage=usage)


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
    principal: Any,
    path: str,
    text_field: str,
    priority_header: str | None,
    session_key: str | None,
) -> Response:
    gateway = gateway_of(request)
    body, document = await _body(request, GenerationRequest)
    view, version = _target(gateway, principal.tenant_id, body.model)
    spec = _spec(view, version)
    if spec.get("engine") != "vllm":
        raise ProtocolMismatch(f"model {body.model!r} ({spec.get('engine')}) does not "
                               "generate text", engine=spec.get("engine"))  # fmt: skip
    max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
    opened = await Passthrough(gateway).open(
        view,
        principal.tenant,
        path,
        lambda chosen: document | {"model": f"{view.name}:{chosen}"},
        priority=_priority(priority_header),
        timeout_ms=float(view.policy.timeout_ms),
        input_size=_text_size(document.get(text_field)) / 4 + 1,
        output_size=max(1, max_tokens),
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
    if opened.status != 200 and not _openai_shaped(content):
        answer = Response(
            json.dumps({"error": {"message": content.decode(errors="replace")[:500],
                                  "type": "server_error", "param": None,
                                  "code": opened.status}}),
            status_code=opened.status, media_type="application/json",
        )  # fmt: skip
    retry_after = opened.response.headers.get("retry-after")
    if retry_after:
        answer.headers["Retry-After"] = retry_after
    return answer


def _openai_shaped(content: bytes) -> bool:
    try:
        document = json.loads(content)
    except ValueError:
        return False
    return isinstance(document, dict) and isinstance(document.get("error"), dict)


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
