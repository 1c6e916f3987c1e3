"""OpenAI's wire format as Ember serves it under ``/openai/v1``: the request and response
models, the embeddings' encoding, the token estimate admission uses, and the framing of an
error inside a stream of server-sent events. No FastAPI here: the routes
(``ember.api.routes.openai``) read the body, call the gateway and answer with these.

Completions are vLLM's own, passed through untouched: Ember reads only what it needs of
the request (``GenerationRequest``) and wraps an error body only when it is not already
OpenAI-shaped (``error_body``)."""

from __future__ import annotations

import base64
import json
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ember.errors import EngineError, MalformedRequest

MAX_EMBEDDING_INPUTS = 2048
#: Completion length assumed for admission when the request does not say (vLLM's default).
DEFAULT_MAX_TOKENS = 16


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

    def completion_tokens(self) -> int:
        """The completion's length for admission: what the request caps it at, else
        vLLM's default."""
        return max(1, self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS)


# --- embeddings ----------------------------------------------------------------------------


def embedding_texts(body: EmbeddingRequest) -> list[str]:
    """The texts to embed (token arrays are refused: the replica takes text)."""
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise MalformedRequest("input must not be empty")
    if not all(isinstance(t, str) for t in texts):
        raise MalformedRequest("input must be text: token arrays are not supported")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise MalformedRequest(f"input has {len(texts)} items; at most {MAX_EMBEDDING_INPUTS}")
    return [t for t in texts if isinstance(t, str)]


def embedding_response(
    body: EmbeddingRequest, vectors: list[Any], served: str
) -> EmbeddingResponse:
    """The model's vectors as OpenAI's answer (``served``: ``name:version``), checked for
    being vectors of the requested dimensions, base64 (little-endian float32) if asked."""
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
    return EmbeddingResponse(data=data, model=served, usage=usage)


# --- completions ---------------------------------------------------------------------------


def text_size(value: Any, depth: int = 0) -> int:
    """Characters of text in a prompt or messages (for a token estimate)."""
    if isinstance(value, str):
        return len(value)
    if depth > 8:
        return 0
    if isinstance(value, list):
        return sum(text_size(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return sum(text_size(v, depth + 1) for v in value.values())
    return 1 if isinstance(value, int) else 0  # token ids count one each


def sse_error(message: str) -> bytes:
    """An SSE event the ``openai`` client raises as an ``APIError``."""
    error = {"message": message, "type": "server_error", "param": None, "code": "engine-error"}
    return f"data: {json.dumps({'error': error})}\n\n".encode()


def openai_shaped(content: bytes) -> bool:
    """Whether an error body is already OpenAI's ``{"error": {...}}``."""
    try:
        document = json.loads(content)
    except ValueError:
        return False
    return isinstance(document, dict) and isinstance(document.get("error"), dict)


def error_body(content: bytes, status: int) -> bytes:
    """A replica's error answer that is not OpenAI-shaped, wrapped as one (its text cut
    to 500 characters)."""
    return json.dumps({"error": {"message": content.decode(errors="replace")[:500],
                                 "type": "server_error", "param": None,
                                 "code": status}}).encode()  # fmt: skip
