"""The HTTP protocol every Ember server runs (``ember.web.http``): uvicorn's httptools
protocol answering in one write. Driven here with the real uvicorn code on a recording
transport (what was written, in which calls), and once over a real socket."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from ember.web.http import SERVER_OPTIONS, CoalescingProtocol

REQUEST = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"


class Recording(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.kept_open = False  # still open when the exchange was over

    def write(self, data: bytes) -> None:  # type: ignore[override]
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


def exchange(app: Any, request: bytes = REQUEST) -> Recording:
    return asyncio.run(_exchange(app, request))


async def _exchange(app: Any, request: bytes, settle_s: float = 0.05) -> Recording:
    config = uvicorn.Config(app, log_config=None, access_log=False)
    config.load()
    protocol = CoalescingProtocol(config=config, server_state=ServerState(), app_state={})
    transport = Recording()
    protocol.connection_made(transport)
    protocol.data_received(request)
    await asyncio.sleep(settle_s)
    transport.kept_open = not transport.closed
    protocol.connection_lost(None)  # (which closes the transport)
    return transport


def head_and_body(message: bytes) -> tuple[bytes, bytes]:
    head, _, body = message.partition(b"\r\n\r\n")
    return head, body


def test_head_and_body_go_out_in_one_write() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-length", b"5"), (b"x-ember-version", b"v1")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"hello"})

    transport = exchange(app)
    assert len(transport.writes) == 1
    head, body = head_and_body(transport.writes[0])
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-ember-version: v1" in head
    assert body == b"hello"
    assert transport.kept_open  # keep-alive, as uvicorn does


def test_a_slow_first_chunk_does_not_hold_the_head() -> None:
    """A stream whose first chunk takes a while (an LLM's first token): the client has the
    head on the loop's next turn, then each chunk as it comes (uvicorn's chunked framing)."""
    started: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        started.append(True)
        await asyncio.sleep(0.02)
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": False})

    transport = exchange(app)
    assert started
    assert transport.writes[0].endswith(b"\r\n\r\n")  # the head alone, before the first chunk
    assert b"transfer-encoding: chunked" in transport.writes[0]
    assert b"".join(transport.writes[1:]) == b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"


def test_connection_close_is_done_after_the_write() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"no"})

    transport = exchange(app, b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert len(transport.writes) == 1 and transport.writes[0].endswith(b"\r\n\r\nno")
    assert b"connection: close" in transport.writes[0]
    assert not transport.kept_open


def test_an_app_that_fails_after_its_head_sends_nothing_half_done() -> None:
    """uvicorn closes the connection of an app that raises once its answer started; the
    held head is not written after that (a client sees a closed connection, never a head
    without its body followed by the next answer)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"5")]})  # fmt: skip
        raise RuntimeError("boom")

    transport = exchange(app)
    assert not transport.kept_open
    assert all(not w.startswith(b"HTTP/1.1 200") for w in transport.writes)


def test_a_body_longer_than_its_length_is_refused_as_uvicorn_refuses_it() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"toolong"})

    transport = exchange(app)
    assert not transport.kept_open
    assert not any(b"toolong" in w for w in transport.writes)


def test_a_real_server_answers_keep_alive_requests_in_one_segment_each() -> None:
    """Over a real socket: two requests on one connection, each answer whole."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = scope["path"].encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert SERVER_OPTIONS["http"] is CoalescingProtocol  # what ember serve / engine run
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                           **SERVER_OPTIONS))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            for path in (b"/first", b"/second"):
                conn.sendall(b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % path)
                got = b""
                while not got.endswith(path):
                    chunk = conn.recv(65536)
                    assert chunk, "closed early"
                    got += chunk
                head, body = head_and_body(got)
                assert head.startswith(b"HTTP/1.1 200") and body == path
                assert b"\r\nserver:" not in head  # SERVER_OPTIONS: no banner
    finally:
        server.should_exit = True
        thread.join(10)
