"""Lean lanes for hot endpoints: raw ASGI in front of FastAPI's whole stack.

FastAPI's route matching, dependency solving and body validation cost more CPU per
request than the whole gateway hop (profiled: ~35 % of the API process on ``:predict``),
and the middleware around the routes — Starlette's error handler, FastAPI's telemetry and
body limit, Ember's request id, size limit and media-type check — cost about as much again
at light load. A ``FastLane`` sits in front of all of it (``LaneApp.add_lane``): it takes
the requests it fully understands — a POST to its path with a ``Content-Length`` within
the limit and a media type it reads — and does itself the little those layers would have
done for them: the request id (``X-Request-Id`` in and out, bound to log lines), a problem
document for a domain error and a 500 problem for an unexpected one. Everything else —
a chunked or oversized body, another media type, malformed JSON, a schema violation, an
unknown or missing key — goes through the whole stack unchanged, its body replayed, and
therefore gets exactly the answer the FastAPI route gives, RFC 9457 problem and all; the
route stays in the OpenAPI document.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember import tracing
from ember.errors import EmberError
from ember.logs import bound
from ember.web import problems
from ember.web.middleware import last_header, request_id_of


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

ENTERED_KEY = "ember.entered"
"""The scope key under which ``LaneApp`` notes the request's arrival (``perf_counter``)."""

JSON_MEDIA = (b"application/json",)
"""What a JSON lane reads (``+json`` types and an absent Content-Type too, as the control
routes do)."""


class FastLane:
    """Serve ``POST`` requests whose path fully matches ``path`` with ``handler`` (what
    ``takes`` accepts, ``LaneApp`` hands to ``serve``); a request the handler leaves goes
    on to ``app``. ``media``: the Content-Types the lane reads (besides JSON), or None for
    any."""

    def __init__(
        self,
        app: ASGIApp,
        path: re.Pattern[str],
        handler: LaneHandler,
        *,
        max_bytes: int,
        media: tuple[bytes, ...] | None = JSON_MEDIA,
        timing: bytes | None = None,
    ) -> None:
        self.app = app
        self.path = path
        self.handler = handler
        self.max_bytes = max_bytes
        self.media = media
        self.timing = timing

    def takes(self, scope: Scope) -> re.Match[str] | None:
        """The path match when this lane serves the request (body not yet read)."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return None
        match = self.path.fullmatch(scope["path"])
        if match is None:
            return None
        length = last_header(scope, b"content-length")
        if (
            length is None  # chunked: the full stack counts it against the limit
            or not length.isdigit()
            or int(length) > self.max_bytes
            or last_header(scope, b"transfer-encoding") is not None
        ):
            return None
        if self.media is not None:
            ctype = last_header(scope, b"content-type")
            if ctype is not None:
                media = ctype.split(b";")[0].strip().lower()
                if media not in self.media and not media.endswith(b"+json"):
                    return None  # the full stack says 415 (or reads it its own way)
        return match

    async def serve(self, scope: Scope, receive: Receive, send: Send, match: re.Match[str]) -> None:
        """Serve a request ``takes`` matched. With ``timing`` (a ``Server-Timing`` name), an
        answer that carries ``Server-Timing`` gets that part first: the process's whole time
        for the request, from its arrival at the app (before its body is read) to the
        answer's start, so that the rest of the client's latency is the network and the
        HTTP server's parsing."""
        entered = scope.get(ENTERED_KEY) or time.perf_counter()
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
        request_id = request_id_of(scope)
        id_header = (b"x-request-id", request_id.encode())
        with bound(request_id=request_id):
            try:
                answer = await self.handler(scope, match, b"".join(chunks))
            except EmberError as exc:
                await self._respond(
                    await problems.ember_error_response(Request(scope), exc), id_header, send
                )
                return
            except Exception as exc:  # what Starlette's error middleware would do
                await self._respond(await problems.unexpected(Request(scope), exc), id_header, send)
                return
        if answer is None:
            await self._fall_through(scope, receive, send, messages)
            return
        headers = [
            (b"content-length", str(len(answer.body)).encode()),
            (b"content-type", answer.media_type),
            id_header,
            *answer.headers,
        ]
        if self.timing is not None:
            for i, (name, value) in enumerate(headers):
                if name == b"server-timing":
                    whole_ms = (time.perf_counter() - entered) * 1000
                    headers[i] = (name, b"%s;dur=%.3f, %s" % (self.timing, whole_ms, value))
                    break
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})

    @staticmethod
    async def _respond(response: Response, id_header: tuple[bytes, bytes], send: Send) -> None:
        response.raw_headers.append(id_header)
        await send(
            {"type": "http.response.start", "status": response.status_code,
             "headers": response.raw_headers}
        )  # fmt: skip
        await send({"type": "http.response.body", "body": response.body})

    async def _fall_through(
        self, scope: Scope, receive: Receive, send: Send, messages: list[Message]
    ) -> None:
        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


class LaneApp(FastAPI):
    """FastAPI whose lanes (``add_lane``) see requests before its middleware stack."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lanes: list[FastLane] = []

    def add_lane(
        self,
        path: re.Pattern[str],
        handler: LaneHandler,
        *,
        max_bytes: int,
        media: tuple[bytes, ...] | None = JSON_MEDIA,
        timing: bytes | None = None,
    ) -> None:
        self.lanes.append(FastLane(super().__call__, path, handler, max_bytes=max_bytes,
                                   media=media, timing=timing))  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[ENTERED_KEY] = time.perf_counter()
        if scope["type"] == "http" and tracing.traced(scope):  # its server span around all
            await tracing.serve_http(self._serve, scope, receive, send)
            return
        await self._serve(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.lanes and scope["type"] == "http" and not self.root_path:
            for lane in self.lanes:
                match = lane.takes(scope)
                if match is not None:
                    scope["app"] = self
                    await lane.serve(scope, receive, send, match)
                    return
        await super().__call__(scope, receive, send)


def header_values(scope: Scope, *names: bytes) -> list[str | None]:
    """The first value of each header in ``names`` (lower case), latin-1 decoded as
    Starlette does; None where absent. One pass over the headers."""
    found: dict[bytes, str] = {}
    wanted = set(names)
    for key, value in scope["headers"]:
        if key in wanted and key not in found:
            found[key] = value.decode("latin-1")
    return [found.get(name) for name in names]
