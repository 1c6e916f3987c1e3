"""Traces: OpenTelemetry spans across the API, the replicas and the workers.

A request's trace starts at the API from the client's W3C ``traceparent`` (or a new trace
when it sent none) and follows it: the API's server span (``auth``, ``gateway`` with
``cache``, ``admission``, ``route`` and one ``hop`` per replica call), the replica's
server span (``queue``, ``batch``, ``forward``: recorded from the scheduler's own
timestamps), and a job (``traceparent`` in its Celery message; the worker's ``job`` span
and its ``predict`` calls back into the API) or a batch shard (``shard``). Spans of a
model's work carry ``ember.model``, ``ember.version``, ``ember.deployment`` and
``ember.replica`` where known; log lines in a traced request's context and its prediction
log record carry ``trace_id``.

Export is OTLP/HTTP (protobuf) to ``EMBER_OTEL_ENDPOINT`` and off by default. Off, there
is no tracer provider, no exporter and no span: the hot path pays one flag test and one
scan of the request headers for a ``traceparent``. A client's ``traceparent`` is still
honoured then: its trace id is bound to the request's log lines (and its prediction log
record) and passed on unchanged to the replica, so a trace id a client chose finds every
line about its request even with export off.

``setup(settings, service)`` turns tracing on for a process (the API's lifespan, a
replica's app, a worker); ``shutdown()`` flushes and turns it off again.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import Message, Receive, Scope, Send

from ember.logs import bound, get_logger

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from ember.config import Settings

log = get_logger(__name__)

enabled = False
"""Whether this process records and exports spans (``setup``); read on every request."""

TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"
PROPAGATOR = TraceContextTextMapPropagator()
"""W3C Trace Context (``traceparent`` / ``tracestate``): what every hop carries."""

_tracer: trace.Tracer = trace.NoOpTracer()
_provider: TracerProvider | None = None
_NOOP = contextlib.nullcontext(INVALID_SPAN)


def setup(settings: Settings, service: str) -> bool:
    """Turn tracing on for this process when ``EMBER_OTEL_ENDPOINT`` is set: a tracer
    provider (``service.name``: ``EMBER_OTEL_SERVICE_NAME`` or ``service``) that samples
    new traces at ``EMBER_OTEL_SAMPLE_RATIO`` (parent-based: a caller's sampled flag is
    followed) and batches finished spans to the OTLP/HTTP exporter. Returns whether it is
    on. Idempotent; a second call replaces the first's provider."""
    global _tracer, _provider, enabled
    if settings.otel_endpoint is None:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    import ember

    shutdown()
    resource = Resource.create(
        {
            "service.name": settings.otel_service_name or service,
            "service.version": ember.__version__,
            "service.instance.id": f"{os.uname().nodename}:{os.getpid()}",
        }
    )
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.otel_sample_ratio))
    )
    exporter = OTLPSpanExporter(
        endpoint=traces_url(settings.otel_endpoint),
        headers=export_headers(settings),
        timeout=settings.otel_timeout_s,
    )
    provider.add_span_processor(_inherit_processor())
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=settings.otel_export_delay_ms)
    )
    _provider, _tracer, enabled = provider, provider.get_tracer("ember", ember.__version__), True
    log.info("tracing on", endpoint=traces_url(settings.otel_endpoint),
             service=settings.otel_service_name or service,
             sample_ratio=settings.otel_sample_ratio)  # fmt: skip
    return True


INHERITED = ("ember.model", "ember.version", "ember.deployment", "ember.replica")
"""Attributes a span takes from its parent in the same process at its start (a span of a
model's work says which model, version and replica without every caller passing them)."""


def _inherit_processor() -> Any:
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

    class Inherit(SpanProcessor):
        def on_start(self, span: Any, parent_context: otel_context.Context | None = None) -> None:
            parent = trace.get_current_span(parent_context)
            if not isinstance(parent, ReadableSpan) or not parent.attributes:
                return
            own = span.attributes or {}
            for key in INHERITED:
                value = parent.attributes.get(key)
                if value is not None and key not in own:
                    span.set_attribute(key, value)

    return Inherit()


def shutdown() -> None:
    """Flush what is buffered and turn tracing off (no-op when it is off)."""
    global _tracer, _provider, enabled
    provider, _provider = _provider, None
    _tracer, enabled = trace.NoOpTracer(), False
    if provider is not None:
        provider.shutdown()  # flushes the batch processor, then closes the exporter


def force_flush(timeout_ms: int = 5000) -> bool:
    """Send every finished span now (tests, and a worker before it exits)."""
    return _provider.force_flush(timeout_ms) if _provider is not None else True


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base URL (``.../v1/traces`` kept)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def export_headers(settings: Settings) -> dict[str, str]:
    """``EMBER_OTEL_HEADERS`` (``name=value,name=value``) as a dict."""
    raw = settings.otel_headers.get_secret_value() if settings.otel_headers else ""
    pairs = (item.partition("=") for item in raw.split(",") if item.strip())
    return {name.strip(): value.strip() for name, _, value in pairs if name.strip()}


# --- attributes -----------------------------------------------------------------------------


def model_attributes(
    model: str | None,
    version: str | None,
    deployment: str | None = None,
    replica: str | None = None,
) -> dict[str, str]:
    """The attributes of a span of a model's work (those known)."""
    found = {"ember.model": model, "ember.version": version, "ember.deployment": deployment,
             "ember.replica": replica}  # fmt: skip
    return {k: v for k, v in found.items() if v}


def annotate(attributes: Mapping[str, Any]) -> None:
    """Set ``attributes`` on the current span (when it records)."""
    if enabled:
        current = trace.get_current_span()
        if current.is_recording():
            current.set_attributes(attributes)


def trace_id_of(span: Span) -> str | None:
    """The span's trace id as 32 hex digits (what log lines carry), None if invalid."""
    ctx = span.get_span_context()
    return trace.format_trace_id(ctx.trace_id) if ctx.is_valid else None


# --- spans ----------------------------------------------------------------------------------


def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> contextlib.AbstractContextManager[Span]:
    """A child span of the current one, current inside the ``with`` block (an exception
    leaving it is recorded). Off: a shared no-op context manager."""
    if not enabled:
        return _NOOP
    return _tracer.start_as_current_span(name, kind=kind, attributes=attributes)


def record(
    name: str,
    start: float,
    end: float,
    attributes: Mapping[str, Any] | None = None,
    now: tuple[float, int] | None = None,
) -> None:
    """A finished child span of the current one from two ``time.monotonic()`` readings
    taken anyway (the scheduler's stage boundaries): no clock read of its own beyond one
    pair to place them (``now``: a ``(monotonic, time_ns)`` pair to share across spans)."""
    if not enabled:
        return
    mono, wall = now or (time.monotonic(), time.time_ns())
    started = _tracer.start_span(
        name, attributes=attributes, start_time=wall - int((mono - start) * 1e9)
    )
    started.end(end_time=wall - int((mono - max(start, end)) * 1e9))


STAGES = (("queue", "enqueued_at", "free_at"), ("batch", "free_at", "dispatched_at"),
          ("forward", "forward_at", "forward_end_at"))  # fmt: skip
"""The replica's spans from the scheduler's ``timing`` marks: waiting while earlier
batches computed, waiting for the batch window, the batch's forward pass (of the
request's instance whose forward pass ended last, as ``Server-Timing`` reports)."""


def record_stages(timing: Mapping[str, float]) -> None:
    """The replica's ``STAGES`` as finished child spans of the current (server) span."""
    if not enabled or "enqueued_at" not in timing:
        return
    now = clock()
    for name, start, end in STAGES:
        record(name, timing[start], timing[end], None, now)


def clock() -> tuple[float, int]:
    """A ``(monotonic, time_ns)`` pair for ``record``."""
    return time.monotonic(), time.time_ns()


# --- propagation ----------------------------------------------------------------------------


def inject(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` plus the current span's ``traceparent`` (and ``tracestate``) when there
    is a trace — a span of ours, or with tracing off a client's, passed on unchanged."""
    if not otel_context.get_current() or not trace.get_current_span().get_span_context().is_valid:
        return headers  # (an empty context: nothing attached, the common case when off)
    carrier = dict(headers)
    PROPAGATOR.inject(carrier)
    return carrier


def carrier() -> dict[str, str] | None:
    """The current trace context as message headers (a job's or shard's Celery message);
    None when there is none."""
    found: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        PROPAGATOR.inject(found)
    return found or None


def from_task(request: Any) -> dict[str, str]:
    """The trace context a Celery task's message carried (``carrier``'s headers: Celery
    puts a message's custom headers on ``task.request``)."""
    found: dict[str, str] = {}
    headers = getattr(request, "headers", None) or {}
    for name in ("traceparent", "tracestate"):
        value = getattr(request, name, None) or headers.get(name)
        if isinstance(value, str):
            found[name] = value
    return found


@contextlib.contextmanager
def continued(
    carrier: Mapping[str, str] | None,
    name: str,
    attributes: Mapping[str, Any] | None = None,
    kind: SpanKind = SpanKind.CONSUMER,
) -> Iterator[Span]:
    """Continue the trace of ``carrier`` (a job's message headers) with a span ``name``
    (current inside the block), its trace id bound to the log lines; with tracing off,
    only the carrier's trace id, bound to the log lines and passed on."""
    parent = PROPAGATOR.extract(dict(carrier or {}))
    if not enabled:
        remote = trace.get_current_span(parent)
        if not remote.get_span_context().is_valid:
            yield INVALID_SPAN
            return
        token = otel_context.attach(parent)
        try:
            with bound(trace_id=trace_id_of(remote)):
                yield remote
        finally:
            otel_context.detach(token)
        return
    with (
        _tracer.start_as_current_span(name, parent, kind, attributes) as current,
        bound(trace_id=trace_id_of(current)),
    ):
        yield current


@contextlib.contextmanager
def attached(carrier: Mapping[str, str] | None) -> Iterator[None]:
    """``carrier``'s context current inside the block, no span of its own (what a shard
    publishes next stays in its run's trace)."""
    if not carrier:
        yield
        return
    token = otel_context.attach(PROPAGATOR.extract(dict(carrier)))
    try:
        yield
    finally:
        otel_context.detach(token)


def traced(scope: Scope) -> bool:
    """Whether an HTTP request gets a server span (tracing on) or at least its client's
    trace id bound (off, with a ``traceparent``). Off without one: one header scan."""
    if enabled:
        return True
    for key, _ in scope["headers"]:  # noqa: SIM110 - a loop: no generator per request
        if key == TRACEPARENT:
            return True
    return False


ASGICall = Callable[[Scope, Receive, Send], Awaitable[None]]


async def serve_http(call: ASGICall, scope: Scope, receive: Receive, send: Send) -> None:
    """``call`` (an ASGI app) inside the request's server span: the client's context
    continued (or a new trace), the trace id bound to every log line of the request, the
    status code recorded and W3C ``traceresponse`` in the answer. Off: only a client's
    trace id, bound and passed on."""
    carrier = {key.decode("latin-1"): value.decode("latin-1")
               for key, value in scope["headers"] if key in (TRACEPARENT, TRACESTATE)}  # fmt: skip
    parent = PROPAGATOR.extract(carrier)
    if not enabled:
        remote = trace.get_current_span(parent)
        if not remote.get_span_context().is_valid:  # malformed: ignored, as W3C says
            await call(scope, receive, send)
            return
        token = otel_context.attach(parent)
        try:
            with bound(trace_id=trace_id_of(remote)):
                await call(scope, receive, send)
        finally:
            otel_context.detach(token)
        return
    method, path = scope["method"], scope["path"]
    attributes = {"http.request.method": method, "url.path": path}
    with _tracer.start_as_current_span(
        f"{method} {path}", parent, SpanKind.SERVER, attributes, set_status_on_exception=True
    ) as current:
        ctx = current.get_span_context()
        own: dict[str, str] = {}
        PROPAGATOR.inject(own)  # the server span's traceparent: what traceresponse says
        response = (b"traceresponse", own["traceparent"].encode("latin-1"))

        status = 0

        async def send_traced(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                current.set_attribute("http.response.status_code", status)
                if status >= 500:
                    current.set_status(Status(StatusCode.ERROR))
                message.setdefault("headers", []).append(response)
            await send(message)

        with bound(trace_id=trace.format_trace_id(ctx.trace_id)):
            try:
                await call(scope, receive, send_traced)
            finally:
                # Named by the route's template where a route served it; else by the path
                # a lane served (a model's), never by a path nothing serves (a scanner's
                # random paths would each be a span name of its own).
                template = getattr(scope.get("route"), "path", None)
                if isinstance(template, str):
                    current.update_name(f"{method} {template}")
                    current.set_attribute("http.route", template)
                elif status in (0, 404, 405):
                    current.update_name(method)
