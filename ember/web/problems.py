"""RFC 9457 problem details: the one place where errors become HTTP responses."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember.errors import BackPressure, EmberError, Upstream
from ember.logs import get_logger

log = get_logger(__name__)
PROBLEM_JSON = "application/problem+json"
TYPE_BASE = "https://ember.dev/problems/"


class Problem(BaseModel):
    """An RFC 9457 problem document (extension members allowed)."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None


def problem_responses(*statuses: tuple[int, str]) -> dict[int | str, dict[str, Any]]:
    return {
        status: {"model": Problem, "content": {PROBLEM_JSON: {}}, "description": title}
        for status, title in statuses
    }


#: What the data plane may answer besides the control plane's errors.
DATA_PLANE_RESPONSES = problem_responses(
    (429, "Shed: over budget or queues full (see Retry-After)"),
    (502, "The replica failed"),
    (503, "No ready replica"),
    (504, "Deadline exceeded"),
)

PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": Problem, "content": {PROBLEM_JSON: {}}, "description": title}
    for status, title in [
        (400, "Malformed request"),
        (401, "Authentication required"),
        (403, "Forbidden"),
        (404, "Not found"),
        (409, "Conflict"),
        (413, "Payload too large"),
        (415, "Unsupported media type"),
        (422, "Invalid input"),
    ]
}


#: OpenAI's error ``type`` per status (its clients pick the exception by status alone).
OPENAI_ERROR_TYPES = {401: "authentication_error", 403: "permission_error",
                      404: "not_found_error", 429: "rate_limit_error"}  # fmt: skip


def protocol_error(path: str, status: int, code: str, detail: str) -> dict[str, Any]:
    """The ``error`` member a standard protocol's own clients read, added beside the RFC
    9457 members on that protocol's routes: the Open Inference Protocol (``/v2``) wants
    ``{"error": "<message>"}``, OpenAI's clients ``{"error": {"message", "type", "code"}}``."""
    if path == "/v2" or path.startswith("/v2/"):
        return {"error": detail}
    if path.startswith("/openai/"):
        kind = "server_error" if status >= 500 else "invalid_request_error"
        kind = OPENAI_ERROR_TYPES.get(status, kind)
        return {"error": {"message": detail, "type": kind, "param": None, "code": code}}
    return {}


def problem(
    status: int, code: str, title: str, detail: str, request: Request, **extra: Any
) -> JSONResponse:
    body = {
        "type": TYPE_BASE + code,
        "title": title,
        "status": status,
        "detail": detail,
        "instance": request.url.path,
        **extra,
        **protocol_error(request.url.path, status, code, detail),
    }
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


async def ember_error_response(request: Request, exc: Exception) -> JSONResponse:
    """An ``EmberError`` as its problem document (raw ASGI lanes call this too)."""
    assert isinstance(exc, EmberError)
    if isinstance(exc, Upstream):
        headers = {"Retry-After": exc.retry_after} if exc.retry_after else {}
        code = str(exc.body.get("type", "")).rsplit("/", 1)[-1] or "upstream"
        body = exc.body | protocol_error(request.url.path, exc.upstream_status, code, exc.detail)
        return JSONResponse(body, exc.upstream_status, media_type=PROBLEM_JSON, headers=headers)
    if exc.status >= 500:
        log.error("request failed", error=exc.code, detail=exc.detail)
    response = problem(exc.status, exc.code, exc.title, exc.detail, request, **exc.extra)
    if isinstance(exc, BackPressure):
        response.headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return response


def _location(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"location": _location(tuple(e.get("loc", ()))), "message": e.get("msg", ""),
         "type": e.get("type", "")}
        for e in exc.errors()
    ]  # fmt: skip
    if any(e["type"] == "json_invalid" for e in errors):
        first = next(e for e in exc.errors() if e.get("type") == "json_invalid")
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return problem(400, "malformed-request", "Malformed request",
                       f"request body is not valid JSON: {reason}", request)  # fmt: skip
    detail = "; ".join(f"{e['location']}: {e['message']}" for e in errors[:5])
    return problem(422, "invalid-input", "Invalid input", detail, request, errors=errors)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not-found", 405: "method-not-allowed", 413: "payload-too-large",
             415: "unsupported-media-type"}  # fmt: skip
    code = codes.get(exc.status_code, f"http-{exc.status_code}")
    title = code.replace("-", " ").capitalize()
    response = problem(exc.status_code, code, title, str(exc.detail), request)
    for key, value in (exc.headers or {}).items():
        response.headers[key] = value
    return response


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    """An unhandled exception: logged with its traceback, answered as a bare 500 problem."""
    log.exception("unhandled error", path=request.url.path)
    return problem(500, "internal", "Internal error", "an unexpected error occurred", request)


def install(app: FastAPI) -> None:
    app.add_exception_handler(EmberError, ember_error_response)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, unexpected)
