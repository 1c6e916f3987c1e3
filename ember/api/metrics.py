"""``/metrics``: the pools' and the gateway's Prometheus series, never open to anyone.

Two ways, the operator's choice (``EMBER_METRICS_PORT``):

- unset: ``GET /metrics`` on the API port needs a key like every other route. An admin
  key reads every series; any other key only its own tenant's (the series labelled
  ``tenant="<its name>"``: platform-wide series such as standby processes or the
  prediction log are the operator's). Prometheus scrapes it with a bearer token
  (``authorization: {credentials: <admin key>}`` in the scrape config).
- set: ``/metrics`` is not on the API port at all; it is served, without a key, on that
  port bound to ``127.0.0.1`` only (a sidecar or a node agent scrapes it there).
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import PlainTextResponse

from ember.api.deps import PrincipalDep
from ember.logs import get_logger

log = get_logger(__name__)
MEDIA = "text/plain; version=0.0.4; charset=utf-8"
LOOPBACK = "127.0.0.1"
MAX_REQUEST_HEAD = 8 * 1024
"""Bytes of request line and headers the loopback server reads before it gives up."""
READ_TIMEOUT_S = 10.0

router = APIRouter(tags=["health"])


def render(app: FastAPI, tenant: str | None) -> bytes:
    """Every series (``tenant`` None) or that tenant's; nothing without the pools."""
    gateway = getattr(app.state, "gateway", None)
    if gateway is None:
        return b""
    data: bytes = gateway.controller.metrics.render(tenant)
    return data


@router.get(
    "/metrics",
    summary="Prometheus metrics of the pools and the gateway (an admin key: every tenant's)",
    response_class=PlainTextResponse,
)
def metrics(request: Request, principal: PrincipalDep) -> Response:
    tenant = None if principal.is_admin else principal.tenant
    return Response(render(request.app, tenant), media_type=MEDIA)


class LoopbackMetrics:
    """A minimal HTTP server on ``127.0.0.1:<port>`` answering ``GET /metrics`` (every
    series, no key: only this host reaches it) and 404 to anything else. It runs on the
    API's event loop; each connection gets one answer and is closed."""

    def __init__(self, app: FastAPI, port: int) -> None:
        self.app, self.port = app, port
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(
            self._answer, LOOPBACK, self.port, limit=MAX_REQUEST_HEAD
        )
        log.info("metrics served on loopback", url=f"http://{LOOPBACK}:{self.port}/metrics")

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)
            self.server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            parts = head.split(b"\r\n", 1)[0].split()
            method = parts[0] if parts else b""
            path = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b""
            if method in (b"GET", b"HEAD") and path == b"/metrics":
                body = await asyncio.to_thread(render, self.app, None)
                status, media = b"200 OK", MEDIA.encode()
            else:
                body, status, media = b"not found\n", b"404 Not Found", b"text/plain"
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: " + media
                + b"\r\nContent-Length: " + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n" + (body if method != b"HEAD" else b"")
            )  # fmt: skip
            await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
