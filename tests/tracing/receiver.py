"""A tiny OTLP/HTTP receiver: what a collector does with ``POST /v1/traces``, in memory.

The processes under test export with the real OTLP/HTTP exporter (protobuf) to it; each
request is decoded with ``opentelemetry-proto`` (the exporter's own dependency) into
``Span`` rows. Separate processes cannot share an in-memory exporter; this is the same
collection, over the wire they really use."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: int

    def get(self, key: str) -> Any:
        return self.attributes.get(key)


@dataclass
class Receiver:
    url: str
    spans: list[Span] = field(default_factory=list)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def of_trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return sorted((s for s in self.spans if s.trace_id == trace_id),
                          key=lambda s: s.start_ns)  # fmt: skip

    def wait(self, check: Callable[[], bool], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in self.spans})
                raise AssertionError(f"the spans never arrived; got {names}")
            time.sleep(0.1)


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def decode(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    found = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found.append(
                    Span(
                        service=str(resource.get("service.name")),
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        status=span.status.code,
                    )
                )
    return found


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver("")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path != "/v1/traces" or self.headers.get("Content-Type") != (
                "application/x-protobuf"
            ):
                self.send_response(404)
                self.end_headers()
                return
            spans = decode(body)
            with receiver.lock:
                receiver.spans.extend(spans)
                receiver.requests += 1
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
