"""The lean lane: what it takes it answers, what it leaves reaches the app unchanged."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from starlette.testclient import TestClient
from starlette.types import Scope

from ember.api import problems
from ember.api.lane import Answer, FastLane, header_values
from ember.errors import BackPressure


def lane_app() -> FastAPI:
    app = FastAPI()
    problems.install(app)

    @app.post("/items/{name}")
    async def slow(name: str, request: Request) -> dict[str, str]:
        return {"by": "route", "name": name, "body": (await request.body()).decode()}

    async def lean(scope: Scope, match: re.Match[str], raw: bytes) -> Answer | None:
        (mode,) = header_values(scope, b"x-mode")
        if mode == "shed":
            raise BackPressure("queues full", retry_after_s=2.4)
        if mode == "leave":
            return None
        return Answer(b'{"by":"lane","name":"%s"}' % match["name"].encode(), [(b"x-by", b"lane")])

    app.add_middleware(FastLane, path=re.compile("/items/(?P<name>[a-z]+)"), handler=lean)
    return app


def test_lane_answers_leaves_and_refuses() -> None:
    client = TestClient(lane_app())
    took = client.post("/items/abc", content=b"x")
    assert took.json() == {"by": "lane", "name": "abc"} and took.headers["x-by"] == "lane"
    assert took.headers["content-length"] == str(len(took.content))
    # Left to the app: the body the lane read is replayed, byte for byte.
    left = client.post("/items/abc", content=b"payload" * 1000, headers={"x-mode": "leave"})
    assert left.json() == {"by": "route", "name": "abc", "body": "payload" * 1000}
    # Not its path (a digit) or not a POST: the app's routing decides.
    assert client.post("/items/abc1", content=b"y").json()["by"] == "route"
    assert client.get("/items/abc").status_code == 405
    # A domain error is the same problem document the app's handler writes.
    shed = client.post("/items/abc", headers={"x-mode": "shed"})
    assert shed.status_code == 429 and shed.headers["retry-after"] == "2"
    assert shed.headers["content-type"] == problems.PROBLEM_JSON
    assert (
        shed.json()["type"].endswith("/back-pressure") and shed.json()["instance"] == "/items/abc"
    )
