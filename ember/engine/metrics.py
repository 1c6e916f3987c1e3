"""Prometheus metrics of one replica. Every series carries model and version."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ember.engine.spec import Priority

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
        for p in Priority:
            self.queue_depth.labels(**self.labels, priority=p.label).set(0)

    def depth(self, priority: Priority, value: int) -> None:
        self.queue_depth.labels(**self.labels, priority=priority.label).set(value)

    def reject(self, reason: str, n: int = 1) -> None:
        self.rejected.labels(**self.labels, reason=reason).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
