"""Pass-through to a replica's own HTTP routes (vLLM's OpenAI API), streaming included.

The gateway's ``predict`` speaks ``/infer``; an LLM replica also answers OpenAI's routes
itself, with continuous batching and server-sent events that must reach the client as
they are produced. This module takes such a request through the same parts of the
``Gateway`` — admission (tenant budget in model units, priority, deadline), the version
pick by traffic weight, the router (least in-flight units, sticky sessions), the retry
budget, the shared HTTP client and the metrics — and hands back the replica's response
as a stream. The bytes are passed through untouched; the replica's in-flight units are
released, and success is recorded, when the last byte has gone (or the client left).

A request is retried on another replica only before any byte has been answered: when
the replica could not be reached or shed it (429/503), within the retry budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

from ember import tracing
from ember.domain.spec import Priority, replica_auth
from ember.errors import DeadlineExceeded, EngineError, NotFound, NotReady
from ember.logs import get_logger, model_context
from ember.serving.gateway import RETRYABLE_STATUS, Gateway
from ember.serving.router import Route, pick_replica, pick_version, record_failure, record_success
from ember.serving.routing import DeploymentView

log = get_logger(__name__)
#: Largest error body read back from a replica (it is passed on to the client).
MAX_ERROR_BYTES = 64 * 1024
#: Most answer bytes kept for a deployment that logs payloads (the digest covers all).
MAX_LOGGED_BYTES = 1024 * 1024


@dataclass
class Opened:
    """A replica's answer, headers read, body not yet; ``body()`` or ``stream()`` it once."""

    gateway: Gateway
    response: httpx.Response
    route: Route
    units: float
    deployment: str
    model: str
    version: str
    attempts: int
    started: float
    deadline: float
    view: DeploymentView
    tenant: str
    request: dict[str, Any]
    _done: bool = field(default=False, repr=False)
    _digest: Any = field(default_factory=hashlib.sha256, repr=False)
    _kept: list[bytes] = field(default_factory=list, repr=False)
    _kept_bytes: int = field(default=0, repr=False)
    _tail: bytes = field(default=b"", repr=False)

    def _seen(self, chunk: bytes) -> bytes:
        """Hash what reaches the client (and keep it, bounded, for payload logging)."""
        self._digest.update(chunk)
        self._tail = (self._tail + chunk)[-64:]
        if self.view.policy.log_payloads and self._kept_bytes < MAX_LOGGED_BYTES:
            self._kept.append(chunk)
            self._kept_bytes += len(chunk)
        return chunk

    @property
    def status(self) -> int:
        return self.response.status_code

    @property
    def replica_id(self) -> str:
        return self.route.replica_id

    @property
    def media_type(self) -> str:
        return str(self.response.headers.get("content-type", "application/json"))

    async def body(self) -> bytes:
        """The whole body (an error body at most ``MAX_ERROR_BYTES``), within the deadline."""
        ok = False
        try:
            limit = None if self.status == 200 else MAX_ERROR_BYTES
            remaining = max(0.001, self.deadline - time.monotonic())
            try:
                async with asyncio.timeout(remaining):
                    content = self._seen(await _read(self.response, limit))
            except TimeoutError:
                raise DeadlineExceeded(
                    f"{self.deployment}:{self.version} did not answer within the deadline"
                ) from None
            except httpx.HTTPError as exc:
                raise EngineError(
                    f"replica {self.replica_id} failed mid-answer: {type(exc).__name__}"
                ) from exc
            ok = self.status == 200
            return content
        finally:
            await self._finish(ok)

    async def stream(self, on_error: Callable[[str], bytes] | None = None) -> AsyncIterator[bytes]:
        """The body as it arrives. A replica that fails mid-stream ends it with
        ``on_error(message)`` (e.g. an SSE error event) when given."""
        ok = False
        try:
            async for chunk in self.response.aiter_bytes():
                yield self._seen(chunk)
            ok = self.status == 200
        except httpx.HTTPError as exc:
            message = f"replica {self.replica_id} failed mid-stream: {type(exc).__name__}"
            with model_context(self.model, self.version, deployment=self.deployment):
                log.warning("stream broken", replica_id=self.replica_id, error=type(exc).__name__)
            record_failure(self.route)
            if on_error is not None:
                yield on_error(message)
        finally:
            await self._finish(ok)

    async def close(self) -> None:
        """Release the replica (idempotent): for a stream its reader never finished."""
        await self._finish(False)

    def _whole_event_stream(self) -> bool:
        """An OpenAI event stream is whole once its last event, ``data: [DONE]``, went out.
        Its client stops reading there and may leave before the relay has seen the
        replica's end of the stream (the server then cancels the relay): that answer was
        not cut short."""
        return (
            self.status == 200
            and "text/event-stream" in self.media_type
            and self._tail.rstrip().endswith(b"data: [DONE]")
        )

    async def _finish(self, ok: bool) -> None:
        if self._done:
            return
        ok = ok or self._whole_event_stream()
        self._done = True
        self.route.inflight_units -= self.units
        control = self.gateway.control
        if ok:
            record_success(self.route)
            control.mark_ok(self.route.replica_id)
            control.metrics.answered(self.view, self.version, time.monotonic() - self.started)
        elif self.status >= 500:
            record_failure(self.route)
        with model_context(self.model, self.version, deployment=self.deployment):
            kept = b"".join(self._kept)[:MAX_LOGGED_BYTES].decode("utf-8", "replace")
            self.gateway.log_prediction(
                self.view,
                self.tenant,
                self.version,
                self.started,
                status=self.status if ok or self.status != 200 else 502,
                input_value=self.request,
                output_digest=self._digest.hexdigest(),
                output_value=kept if self.view.policy.log_payloads else None,
                instances=1,
                rung="model",
                cache="off",
                replica=self.replica_id,
                attempts=self.attempts,
                error=None
                if ok
                else "incomplete answer"
                if self.status == 200
                else "replica error",
            )
        with anyio.CancelScope(shield=True):  # also when the client went away mid-stream
            await self.response.aclose()


async def _read(response: httpx.Response, limit: int | None) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        parts.append(chunk)
        size += len(chunk)
        if limit is not None and size >= limit:
            break
    return b"".join(parts)[:limit]


class Passthrough:
    """Send one request to a replica route of a deployment, as the gateway would."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def open(
        self,
        view: DeploymentView,
        tenant: str,
        path: str,
        body: Callable[[str], dict[str, Any]],
        *,
        priority: Priority,
        timeout_ms: float,
        input_size: float,
        output_size: float,
        session_key: str | None = None,
        version: str | None = None,
    ) -> Opened:
        """POST ``body(version)`` as JSON to ``path`` on a replica of the chosen version
        and return once its status and headers are in. ``input_size`` / ``output_size``
        (tokens, estimated) price the request in model units for admission and routing."""
        gateway, control = self.gateway, self.gateway.control
        started = time.monotonic()
        deadline = started + timeout_ms / 1000
        key = (view.tenant_id, view.name)
        if version is not None and version not in view.specs:
            raise NotFound(f"version {version!r} is not served by deployment {view.name!r}")
        traffic = {version: 1} if version else control.routable_traffic(view)
        chosen = pick_version(traffic, gateway.rng)
        cost = view.cost(chosen)
        units = cost.cost(input_size, output_size)
        routes = gateway.table.routes(key, chosen)
        if not routes:
            raise NotReady(
                f"version {chosen!r} of {view.name!r} has no ready replica", version=chosen
            )
        gateway.admit(view, tenant, chosen, routes, units, priority, timeout_ms / 1000)
        gateway.budget.deposit()
        payload = body(chosen)
        attempts = 0
        tried: set[str] = set()
        with model_context(view.model, chosen, deployment=view.name):
            while True:
                attempts += 1
                candidates = gateway.candidates(view, chosen, units, tried)
                route = pick_replica(candidates, session_key)
                tried.add(route.replica_id)
                remaining_s = max(0.001, deadline - time.monotonic())
                request = gateway.http.build_request(
                    "POST",
                    f"{route.url}{path}",
                    json=payload,
                    headers=tracing.inject(
                        {"X-Ember-Priority": priority.label} | replica_auth(route.secret)
                    ),  # the replica continues the request's trace
                    timeout=httpx.Timeout(remaining_s + 1.0, connect=min(5.0, remaining_s + 1)),
                )
                route.inflight_units += units
                try:
                    response = await gateway.http.send(request, stream=True)
                except BaseException as exc:
                    route.inflight_units -= units
                    if not isinstance(exc, httpx.TransportError):
                        raise
                    record_failure(route)
                    if time.monotonic() < deadline and gateway.budget.try_withdraw():
                        control.metrics.request(view, chosen, "retried")
                        log.warning("replica unreachable, retrying", replica_id=route.replica_id,
                                    error=type(exc).__name__)  # fmt: skip
                        continue
                    raise EngineError(
                        f"replica {route.replica_id} failed: {type(exc).__name__}"
                    ) from exc
                if (
                    response.status_code in RETRYABLE_STATUS
                    and time.monotonic() < deadline
                    and gateway.budget.try_withdraw()
                ):
                    route.inflight_units -= units
                    with anyio.CancelScope(shield=True):
                        await response.aclose()
                    control.metrics.request(view, chosen, "retried")
                    continue
                return Opened(
                    gateway,
                    response,
                    route,
                    units,
                    view.name,
                    view.model,
                    chosen,
                    attempts,
                    started,
                    deadline,
                    view,
                    tenant,
                    payload,
                )
