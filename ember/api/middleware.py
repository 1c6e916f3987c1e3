"""ASGI middleware: request ids bound to the log context, and a hard body-size limit."""

from __future__ import annotations

import json
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.api.problems import PROBLEM_JSON, TYPE_BASE, protocol_error
from ember.logs import bound


class RequestContext:
    """Give every request an id (``X-Request-Id`` in and out) and bind it to log lines."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming if 0 < len(incoming) <= 64 and incoming.isprintable() else ""
        request_id = request_id or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        with bound(request_id=request_id):
            await self.app(scope, receive, send_with_id)


class BodyLimit:
    """Refuse bodies over ``max_bytes`` with 413 — by Content-Length up front, and by
    counting while streaming (a chunked or lying client cannot get past it)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._reject(scope, send)
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


class JsonBodies:
    """Control routes take JSON. A body without Content-Type is read as JSON (what a
    hand-written ``curl -X POST --data`` would mean); any other explicit type is a 415,
    never a confusing schema error."""

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
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        ctype = dict(scope["headers"]).get(b"content-type")
        if ctype is None:
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        else:
            media = ctype.split(b";")[0].strip().lower()
            if media != b"application/json" and not media.endswith(b"+json"):
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
