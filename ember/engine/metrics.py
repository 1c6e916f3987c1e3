"""Prometheus metrics of one replica. Every series carries model and version (on a
cluster the scrape adds the pod's tenant id and deployment, see deploy/k8s/monitoring).

``MetricsServer`` serves a ``/metrics`` on a port of its own, without a key: the API's on
loopback (``EMBER_METRICS_PORT``), a replica pod's for the scraper
(``EMBER_ENGINE_METRICS_PORT``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ember.domain.spec import Priority
from ember.logs import get_logger

log = get_logger(__name__)
MEDIA = "text/plain; version=0.0.4; charset=utf-8"
LOOPBACK = "127.0.0.1"
MAX_REQUEST_HEAD = 8 * 1024
"""Bytes of request line and headers the metrics server reads before it gives up."""
READ_TIMEOUT_S = 10.0
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class EngineMetrics:
    def __init__(self, model: str, version: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model": model, "version": version}
        names = ["model", "version"]
        r = self.registry
        self.queue_depth = Gauge(
            "ember_queue_depth", "Queued instances", [*names, "priority"], registry=r
        )
        self.inflight_units = Gauge(
            "ember_inflight_units", "Model units queued or running", names, registry=r
        )
        self.batch_size = Histogram(
            "ember_batch_size",
            "Instances per forward pass",
            names,
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "ember_request_latency_seconds",
            "Request latency",
            [*names, "priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "ember_queue_seconds",
            "Time a request waited before its forward pass began",
            [*names, "priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.forward_passes = Counter("ember_forward_passes", "Forward passes", names, registry=r)
        self.inferences = Counter("ember_inferences", "Instances inferred", names, registry=r)
        self.rejected = Counter(
            "ember_rejected", "Instances refused or dropped", [*names, "reason"], registry=r
        )
        # the series every request touches, bound once: ``labels()`` costs a few µs a
        # call, and ten times that right after a forward pass has left the caches cold
        # (measured: 0.12 ms for the four calls that close a batch on minilm)
        self.inflight = self.inflight_units.labels(**self.labels)
        self.passes = self.forward_passes.labels(**self.labels)
        self.batches = self.batch_size.labels(**self.labels)
        self.inferred = self.inferences.labels(**self.labels)
        self._depth = {
            p: self.queue_depth.labels(**self.labels, priority=p.label) for p in Priority
        }
        self._answered: dict[Priority, tuple[Any, Any]] = {}  # latency, queue time
        for gauge in self._depth.values():
            gauge.set(0)

    def depth(self, priority: Priority, value: int) -> None:
        self._depth[priority].set(value)

    def answered(self, priority: Priority, latency_s: float, queue_s: float) -> None:
        """A request of ``priority`` answered: its latency and its time queued (a class's
        series appear with its first request)."""
        children = self._answered.get(priority)
        if children is None:
            labels = self.labels | {"priority": priority.label}
            children = self._answered[priority] = (
                self.latency.labels(**labels),
                self.queue_time.labels(**labels),
            )
        children[0].observe(latency_s)
        children[1].observe(queue_s)

    def reject(self, reason: str, n: int = 1) -> None:
        self.rejected.labels(**self.labels, reason=reason).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """A minimal HTTP server on ``host:port`` answering ``GET /metrics`` with ``render()``
    (no key: who reaches the port is the operator's to fence) and 404 to anything else. It
    runs on the process's event loop; each connection gets one answer and is closed."""

    def __init__(self, render: Callable[[], bytes], port: int, host: str = LOOPBACK) -> None:
        self.render, self.port, self.host = render, port, host
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(
            self._answer, self.host, self.port, limit=MAX_REQUEST_HEAD
        )
        log.info("metrics served", url=f"http://{self.host}:{self.port}/metrics")

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
                body = await asyncio.to_thread(self.render)
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


def replica_text(replica: Any) -> bytes:
    """A replica's exposition text: its series and its engine's own (``/metrics``)."""
    data: bytes = replica.metrics.render() if replica.metrics else b""
    if replica.engine is not None:
        data += replica.engine.metrics_text()
    return data


async def serve_replica_metrics(replica: Any, port: int | None) -> MetricsServer | None:
    """``EMBER_ENGINE_METRICS_PORT``: the replica's ``/metrics`` on every address of
    ``port``, no secret (a pod's scraper); None when unset or the port is taken (logged:
    the replica serves on regardless)."""
    if port is None:
        return None
    server = MetricsServer(lambda: replica_text(replica), port, "0.0.0.0")
    try:
        await server.start()
    except OSError as exc:
        log.warning("replica metrics port not served", port=port, error=str(exc))
        return None
    return server
