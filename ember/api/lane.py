"""A lean lane for a hot endpoint: raw ASGI in front of FastAPI's router.

FastAPI's route matching, dependency solving and body validation cost more CPU per
request than the whole gateway hop (profiled: ~35 % of the API process on ``:predict``).
A ``FastLane`` answers the requests it fully understands — the well-formed, authenticated
happy path and the domain errors its handler raises — and hands everything else to the
application unchanged, its body replayed. Whatever the lane does not take (malformed JSON,
a schema violation, an unknown or missing key) therefore gets exactly the answer the
FastAPI route gives, RFC 9457 problem and all, and the route stays in the OpenAPI document.

Install it innermost (``add_middleware`` first), so the request id, the body limit and the
media-type check in front of it apply to both ways through.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.api import problems
from ember.errors import EmberError


@dataclass(slots=True)
class Answer:
    """A lane's successful answer: JSON bytes, extra headers (lower-case names)."""

    body: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    status: int = 200
    media_type: bytes = b"application/json"


LaneHandler = Callable[[Scope, "re.Match[str]", bytes], Awaitable[Answer | None]]
"""``(scope, path match, body) -> Answer``, or None to leave the request to the app.
It may raise ``EmberError`` (answered as problem+json); it must return None before any
side effect if it is going to return None at all."""


class FastLane:
    """Serve ``POST`` requests whose path fully matches ``path`` with ``handler``."""

    def __init__(self, app: ASGIApp, path: re.Pattern[str], handler: LaneHandler) -> None:
        self.app = app
        self.path = path
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = None
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            match = self.path.fullmatch(scope["path"])
        if match is None:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        chunks: list[bytes] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # a disconnect: the app deals with it
                await self._fall_through(scope, receive, send, messages)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        try:
            answer = await self.handler(scope, match, b"".join(chunks))
        except EmberError as exc:
            response = await problems.ember_error_response(Request(scope), exc)
            await response(scope, receive, send)
            return
        if answer is None:
            await self._fall_through(scope, receive, send, messages)
            return
        headers = [
            (b"content-length", str(len(answer.body)).encode()),
            (b"content-type", answer.media_type),
            *answer.headers,
        ]
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})

    async def _fall_through(
        self, scope: Scope, receive: Receive, send: Send, messages: list[Message]
    ) -> None:
        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def header_values(scope: Scope, *names: bytes) -> list[str | None]:
    """The first value of each header in ``names`` (lower case), latin-1 decoded as
    Starlette does; None where absent. One pass over the headers."""
    found: dict[bytes, str] = {}
    wanted = set(names)
    for key, value in scope["headers"]:
        if key in wanted and key not in found:
            found[key] = value.decode("latin-1")
    return [found.get(name) for name in names]
