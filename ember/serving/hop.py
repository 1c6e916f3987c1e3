"""The gateway's hop to a replica: a lean HTTP/1.1 keep-alive client.

The predict hop is one small JSON POST to a loopback (or in-cluster) replica and one small
JSON answer. A general client spends most of its CPU on what this hop never needs —
cookie jars, redirects, tracing hooks, URL objects, multidict headers, per-request timeout
tasks (measured here: aiohttp ~0.5 ms of CPU per request, this client ~0.1 ms). This one
writes the request in one ``write``, parses the answer on an ``asyncio.Protocol`` and keeps
connections warm per replica, most recently used first.

Errors: ``ReplicaUnreachable`` when the replica cannot be reached or drops the connection
before a complete answer (refused, reset, closed, malformed); ``TimeoutError`` when no
complete answer came within the timeout. A connection that was idle in the pool and turns
out to be closed (the replica's keep-alive timer won the race) is retried once on a fresh
connection — only then, when the replica cannot have seen the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import cast

from opentelemetry.trace import SpanKind

from ember import tracing
from ember.domain.spec import REPLICA_SECRET_HEADER

KEEPALIVE_S = 3.0
"""Idle connections older than this are not reused (uvicorn closes them after 5 s)."""
MAX_IDLE = 256
"""Idle connections kept per replica."""
MAX_HEAD = 64 * 1024
_ANSWERED = (("x-ember-replica", "ember.replica"), ("x-ember-model", "ember.model"),
             ("x-ember-version", "ember.version"))  # fmt: skip


class ReplicaUnreachable(ConnectionError):
    """The replica refused, reset or closed the connection, or answered malformed HTTP."""


@dataclass(frozen=True, slots=True)
class HopAnswer:
    status_code: int
    headers: dict[str, str]
    """Lower-case names; the last value of a repeated header."""
    content: bytes


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.answer: asyncio.Future[HopAnswer] | None = None
        self.closed = False
        self.received = False
        self.idle_since = 0.0
        self._head: tuple[int, dict[str, str]] | None = None
        self._body_at = 0
        self._length: int | None = None  # None: chunked
        self._keep = True

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.received = True
        self.buffer += data
        answer = self.answer
        if answer is None or answer.done():
            if answer is None:  # bytes nobody asked for: the connection is unusable
                self.close()
            return
        try:
            done = self._parse()
        except ReplicaUnreachable as exc:
            answer.set_exception(exc)
            self.close()
            return
        if done is not None:
            answer.set_result(done)

    def eof_received(self) -> bool:
        self._lost(ReplicaUnreachable("the replica closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(ReplicaUnreachable(f"connection lost: {exc or 'closed'}"))

    def _lost(self, exc: ReplicaUnreachable) -> None:
        self.closed = True
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(exc)

    # --- requests -----------------------------------------------------------------------

    def send(self, request: bytes, answer: asyncio.Future[HopAnswer]) -> None:
        assert self.transport is not None
        self.buffer.clear()
        self.received = False
        self._head, self._body_at, self._length, self._keep = None, 0, 0, True
        self.answer = answer
        self.transport.write(request)

    def reusable(self) -> bool:
        return self._keep and not self.closed and not self.buffer

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _parse(self) -> HopAnswer | None:
        """The complete answer in the buffer, or None while it is still arriving."""
        if self._head is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD:
                    raise ReplicaUnreachable("the replica's response head is too large")
                return None
            self._head = self._parse_head(bytes(self.buffer[:end]))
            self._body_at = end + 4
        status, headers = self._head
        if self._length is not None:
            end = self._body_at + self._length
            if len(self.buffer) < end:
                return None
            content = bytes(self.buffer[self._body_at : end])
            del self.buffer[:end]
        else:
            chunked = self._dechunk()
            if chunked is None:
                return None
            content = chunked
        if self.buffer:  # more than one answer: never reuse such a connection
            self._keep = False
        self.answer = None
        return HopAnswer(status, headers, content)

    def _parse_head(self, head: bytes) -> tuple[int, dict[str, str]]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ReplicaUnreachable(f"malformed status line from the replica: {lines[0]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ReplicaUnreachable("malformed header line from the replica")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._length = None
        else:
            length = headers.get("content-length", "0")
            if not length.isdigit():
                raise ReplicaUnreachable("malformed Content-Length from the replica")
            self._length = int(length)
        connection = headers.get("connection", "").lower()
        self._keep = parts[0] == "HTTP/1.1" and "close" not in connection
        return int(parts[1]), headers

    def _dechunk(self) -> bytes | None:
        """The whole chunked body (and consume it), or None while it is incomplete."""
        at, pieces = self._body_at, list[bytes]()
        while True:
            line_end = self.buffer.find(b"\r\n", at)
            if line_end < 0:
                return None
            size_text = bytes(self.buffer[at:line_end]).split(b";")[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ReplicaUnreachable("malformed chunk size from the replica") from None
            start = line_end + 2
            if size == 0:
                trailer_end = self.buffer.find(b"\r\n\r\n", line_end)
                if trailer_end < 0:
                    return None
                del self.buffer[: trailer_end + 4]
                return b"".join(pieces)
            if len(self.buffer) < start + size + 2:
                return None
            pieces.append(bytes(self.buffer[start : start + size]))
            at = start + size + 2


class ReplicaClient:
    """Keep-alive connections to replicas, per ``host:port``; safe for one event loop."""

    def __init__(self, keepalive_s: float = KEEPALIVE_S, max_idle: int = MAX_IDLE) -> None:
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}
        self._heads: dict[tuple[str, int, str, str], bytes] = {}

    async def post(
        self,
        base_url: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        timeout_s: float,
        content_type: str = "application/json",
        secret: str = "",
    ) -> HopAnswer:
        """POST ``body`` (JSON unless ``content_type`` says otherwise) to ``base_url +
        path``; the complete answer. ``secret``: the replica API's (sent as
        ``REPLICA_SECRET_HEADER``; the head that carries it is made once per replica).
        Traced: in a ``hop`` span whose ``traceparent`` the replica continues."""
        if not tracing.enabled:  # a client's traceparent, if any, is passed on
            return await self._post(
                base_url, path, body, tracing.inject(headers), timeout_s, content_type, secret
            )
        with tracing.span("hop", {"url.full": base_url + path}, SpanKind.CLIENT) as hop:
            answer = await self._post(
                base_url, path, body, tracing.inject(headers), timeout_s, content_type, secret
            )
            hop.set_attribute("http.response.status_code", answer.status_code)
            for name, attribute in _ANSWERED:
                if name in answer.headers:  # who answered: the replica and its version
                    hop.set_attribute(attribute, answer.headers[name])
            return answer

    async def _post(
        self,
        base_url: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        timeout_s: float,
        content_type: str,
        secret: str,
    ) -> HopAnswer:
        host, port = _host_port(base_url)
        head = self._head(host, port, path, secret)
        request = head + _request_tail(body, headers, content_type)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        conn = self._checkout(host, port)
        if conn is not None:
            try:
                return await self._exchange(conn, host, port, request, deadline)
            except ReplicaUnreachable:
                if conn.received:  # it had started to answer: not the keep-alive race
                    raise
        conn = await self._connect(host, port, deadline)
        return await self._exchange(conn, host, port, request, deadline)

    async def _exchange(
        self, conn: _Connection, host: str, port: int, request: bytes, deadline: float
    ) -> HopAnswer:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[HopAnswer] = loop.create_future()
        timer = loop.call_at(deadline, _expire, answer)
        try:
            conn.send(request, answer)
            result = await answer
        except BaseException:
            conn.close()  # an answer may still be on its way: never reuse the connection
            raise
        finally:
            timer.cancel()
        if conn.reusable():
            self._checkin(host, port, conn)
        else:
            conn.close()
        return result

    def _checkout(self, host: str, port: int) -> _Connection | None:
        idle = self._idle.get((host, port))
        if not idle:
            return None
        horizon = time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since > horizon:
                return conn
            conn.close()
        return None

    def _checkin(self, host: str, port: int, conn: _Connection) -> None:
        idle = self._idle.setdefault((host, port), deque())
        conn.idle_since = time.monotonic()
        idle.append(conn)
        horizon = conn.idle_since - self.keepalive_s
        while idle and (len(idle) > self.max_idle or idle[0].idle_since <= horizon):
            idle.popleft().close()

    async def _connect(self, host: str, port: int, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                _, conn = await loop.create_connection(_Connection, host, port)
        except OSError as exc:
            if isinstance(exc, TimeoutError):
                raise
            raise ReplicaUnreachable(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def _head(self, host: str, port: int, path: str, secret: str = "") -> bytes:
        key = (host, port, path, secret)
        head = self._heads.get(key)
        if head is None:
            name = f"[{host}]" if ":" in host else host
            auth = f"{REPLICA_SECRET_HEADER}: {secret}\r\n" if secret else ""
            head = f"POST {path} HTTP/1.1\r\nHost: {name}:{port}\r\n{auth}".encode("latin-1")
            if len(self._heads) < 4096:
                self._heads[key] = head
        return head

    async def close(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()


def _request_tail(body: bytes, headers: dict[str, str], content_type: str) -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (
        f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode(
            "latin-1"
        )
        + body
    )


def _expire(answer: asyncio.Future[HopAnswer]) -> None:
    if not answer.done():
        answer.set_exception(TimeoutError("no answer from the replica within the timeout"))


def _host_port(base_url: str) -> tuple[str, int]:
    """``http://host:port`` (what the controller's routes hold) → (host, port)."""
    rest = base_url.removeprefix("http://").rstrip("/")
    if "/" in rest or rest == base_url:
        raise ValueError(f"the replica hop speaks plain http://host:port, got {base_url!r}")
    host, sep, port = rest.rpartition(":")
    if not sep:
        return rest, 80
    return host.strip("[]"), int(port)
