"""The lean lane: what it takes it answers, what it leaves reaches the app unchanged."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi import Request
from starlette.testclient import TestClient
from starlette.types import Scope

from ember.errors import BackPressure
from ember.web import problems
from ember.web.lane import JSON_MEDIA, Answer, LaneApp, header_values
from ember.web.middleware import BodyLimit, JsonBodies, RequestContext

LIMIT = 4096


def lane_app() -> LaneApp:
    app = LaneApp()
    problems.install(app)

    @app.post("/v1/items/{name}")
    async def slow(name: str, request: Request) -> dict[str, str]:
        return {"by": "route", "name": name, "body": (await request.body()).decode()}

    async def lean(scope: Scope, match: re.Match[str], raw: bytes) -> Answer | None:
        (mode,) = header_values(scope, b"x-mode")
        if mode == "shed":
            raise BackPressure("queues full", retry_after_s=2.4)
        if mode == "crash":
            raise RuntimeError("a bug")
        if mode == "leave":
            return None
        return Answer(b'{"by":"lane","name":"%s"}' % match["name"].encode(), [(b"x-by", b"lane")])

    app.add_lane(re.compile("/v1/items/(?P<name>[a-z]+)"), lean, max_bytes=LIMIT, media=JSON_MEDIA)
    # what the API puts in front of its routes: the lane does their part for what it takes
    app.add_middleware(JsonBodies)
    app.add_middleware(BodyLimit, max_bytes=LIMIT)
    app.add_middleware(RequestContext)
    return app


def test_lane_answers_leaves_and_refuses() -> None:
    client = TestClient(lane_app(), raise_server_exceptions=False)
    took = client.post("/v1/items/abc", content=b"x")
    assert took.json() == {"by": "lane", "name": "abc"} and took.headers["x-by"] == "lane"
    assert took.headers["content-length"] == str(len(took.content))
    # The request id the middleware would give: echoed when sane, else a fresh one.
    assert len(took.headers["x-request-id"]) == 32
    mine = client.post("/v1/items/abc", content=b"x", headers={"x-request-id": "req-7"})
    assert mine.headers["x-request-id"] == "req-7"
    # Left to the app: the body the lane read is replayed, byte for byte.
    left = client.post("/v1/items/abc", content=b"payload" * 500, headers={"x-mode": "leave"})
    assert left.json() == {"by": "route", "name": "abc", "body": "payload" * 500}
    assert len(left.headers["x-request-id"]) == 32
    # Not its path (a digit) or not a POST: the app's routing decides.
    assert client.post("/v1/items/abc1", content=b"y").json()["by"] == "route"
    assert client.get("/v1/items/abc").status_code == 405
    # A domain error is the same problem document the app's handler writes.
    shed = client.post("/v1/items/abc", headers={"x-mode": "shed", "x-request-id": "r1"})
    assert shed.status_code == 429 and shed.headers["retry-after"] == "2"
    assert shed.headers["content-type"] == problems.PROBLEM_JSON
    assert shed.headers["x-request-id"] == "r1"
    assert shed.json()["type"].endswith("/back-pressure")
    assert shed.json()["instance"] == "/v1/items/abc"
    # An unexpected error: a bare 500 problem, as Starlette's error middleware would give.
    crash = client.post("/v1/items/abc", headers={"x-mode": "crash"})
    assert crash.status_code == 500 and crash.json()["type"].endswith("/internal")
    assert "a bug" not in crash.text


@pytest.mark.parametrize(
    ("headers", "content", "status"),
    [
        ({}, b"x" * (LIMIT + 1), 413),  # over the limit: the body limit says so
        ({"content-type": "text/plain"}, b"x", 415),  # another media type: JsonBodies says
    ],
)
def test_what_the_lane_does_not_read_gets_the_stacks_answer(
    headers: dict[str, str], content: bytes, status: int
) -> None:
    client = TestClient(lane_app())
    got = client.post("/v1/items/abc", content=content, headers=headers)
    assert got.status_code == status and got.headers["content-type"] == problems.PROBLEM_JSON
    assert len(got.headers["x-request-id"]) == 32


def test_a_chunked_body_goes_through_the_stack() -> None:
    client = TestClient(lane_app())

    def chunks() -> Iterator[bytes]:
        yield b"ab"
        yield b"cd"

    got = client.post("/v1/items/abc", content=chunks())
    assert got.json() == {"by": "route", "name": "abc", "body": "abcd"}
    too_big = client.post("/v1/items/abc", content=(b"x" * 1024 for _ in range(8)))
    assert too_big.status_code == 413
