"""ASGI middleware: request ids bound to the log context, and a hard body-size limit."""

from __future__ import annotations

import json
import os

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.logs import bound
from ember.web.problems import PROBLEM_JSON, TYPE_BASE, protocol_error


def last_header(scope: Scope, name: bytes) -> bytes | None:
    """The last value of header ``name`` (lower case), as ``dict(scope["headers"])`` gives
    it, without building that dict on every request."""
    found = None
    for key, value in scope["headers"]:
        if key == name:
            found = value
    return found


def request_id_of(scope: Scope) -> str:
    """The request's ``X-Request-Id`` when it is a sane one (1-64 printable characters),
    else a fresh random id."""
    incoming = (last_header(scope, b"x-request-id") or b"").decode("latin-1")
    request_id = incoming if 0 < len(incoming) <= 64 and incoming.isprintable() else ""
    return request_id or os.urandom(16).hex()  # as random as a uuid4, cheaper


class RequestContext:
    """Give every request an id (``X-Request-Id`` in and out) and bind it to log lines."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append(header)
            await send(message)

        with bound(request_id=request_id):
            await self.app(scope, receive, send_with_id)


class BodyLimit:
    """Refuse bodies over ``max_bytes`` with 413 — by Content-Length up front, and by
    counting while streaming a chunked body. A body with a valid Content-Length (and no
    Transfer-Encoding, which would win) needs no counting: the HTTP server frames it by
    that length, so whatever a client sends beyond it is not this request's body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = last_header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._reject(scope, send)
            return
        if length is not None and last_header(scope, b"transfer-encoding") is None:
            await self.app(scope, receive, send)  # framed by its length: nothing to count
            return
        seen = 0
        started = rejected = False

        async def limited_receive() -> Message:
            nonlocal seen, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Answer 413 now; the app then sees a disconnect and whatever it tries
                    # to send afterwards is dropped.
                    if not started:
                        await self._reject(scope, send)
                    rejected = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not rejected:
                raise

    async def _reject(self, scope: Scope, send: Send) -> None:
        detail = f"request body exceeds the {self.max_bytes}-byte limit"
        await send_problem(scope, send, 413, "payload-too-large", "Payload too large", detail)


TENSOR_MEDIA = b"application/x-ember-tensor"
"""``:predict`` also takes a tensor body (``ember.web.tensorbody``, the batch lane)."""


class JsonBodies:
    """Control routes take JSON. A body without Content-Type is read as JSON (what a
    hand-written ``curl -X POST --data`` would mean); any other explicit type is a 415,
    never a confusing schema error — except a tensor body to ``:predict``."""

    def __init__(self, app: ASGIApp, prefixes: tuple[str, ...] = ("/v1/",)) -> None:
        self.app = app
        self.prefixes = prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in ("POST", "PUT", "PATCH")
            or not scope["path"].startswith(self.prefixes)
        ):
            await self.app(scope, receive, send)
            return
        ctype = last_header(scope, b"content-type")
        if ctype is None:
            json_type = (b"content-type", b"application/json")
            scope = {**scope, "headers": [*scope["headers"], json_type]}
        else:
            media = ctype.split(b";")[0].strip().lower()
            tensor = media == TENSOR_MEDIA and scope["path"].endswith(":predict")
            if media != b"application/json" and not media.endswith(b"+json") and not tensor:
                got = media.decode("latin-1")
                detail = f"send JSON with Content-Type: application/json (got {got!r})"
                title = "Unsupported media type"
                await send_problem(scope, send, 415, "unsupported-media-type", title, detail)
                return
        await self.app(scope, receive, send)


async def send_problem(
    scope: Scope, send: Send, status: int, code: str, title: str, detail: str
) -> None:
    body = {"type": TYPE_BASE + code, "title": title, "status": status, "detail": detail,
            "instance": scope.get("path", "")}  # fmt: skip
    body |= protocol_error(scope.get("path", ""), status, code, detail)
    raw = json.dumps(body).encode()
    headers = [
        (b"content-type", PROBLEM_JSON.encode()),
        (b"content-length", str(len(raw)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})
