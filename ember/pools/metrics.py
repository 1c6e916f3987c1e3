"""Prometheus metrics of the pools and the gateway, per tenant, deployment and version.

Every series about a tenant's deployment carries a ``tenant`` label (the tenant's name;
``-`` for standby processes, which belong to no tenant yet): ``render(tenant=...)``
gives a tenant only its own series, the API's ``/metrics`` does that for tenant keys."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ember.pools.cache import ResponseCache
    from ember.pools.controller import DeploymentView, PoolsController
    from ember.pools.predlog import PredictionLog

LATENCY = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
STARTUP = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
NO_TENANT = "-"
"""The ``tenant`` label of what belongs to no tenant (standby processes)."""


class _OnlyTenant:
    """A collector: the samples of ``registry`` labelled ``tenant=<name>``, nothing else."""

    def __init__(self, registry: CollectorRegistry, tenant: str) -> None:
        self.registry, self.tenant = registry, tenant

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            samples = [s for s in metric.samples if s.labels.get("tenant") == self.tenant]
            if samples:
                mine = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                mine.samples = samples
                yield mine


class PoolMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        dv = ["tenant", "deployment", "version"]
        self.replicas = Gauge(
            "ember_replicas", "Replicas by state and tier", [*dv, "state", "tier"], registry=r
        )
        self.replica_seconds = Counter(
            "ember_replica_seconds", "Replica-seconds alive per tier", [*dv, "tier"], registry=r
        )
        self.cold_start = Histogram(
            "ember_cold_start_seconds",
            "Launch to ready",
            ["tenant", "model", "version"],
            buckets=STARTUP,
            registry=r,
        )
        self.replaced = Counter(
            "ember_replicas_replaced", "Replicas replaced", ["tenant", "reason"], registry=r
        )
        self.detect_seconds = Histogram(
            "ember_unhealthy_detect_seconds",
            "Last good answer to kill",
            ["tenant"],
            buckets=STARTUP,
            registry=r,
        )
        self.requests = Counter(
            "ember_gateway_requests", "Gateway outcomes", [*dv, "outcome"], registry=r
        )
        self.latency = Histogram(
            "ember_gateway_latency_seconds", "End-to-end latency", dv, buckets=LATENCY, registry=r
        )
        self.queue_time = Histogram(
            "ember_gateway_queue_seconds",
            "Time in the replica's queue before the forward pass (reported by the replica)",
            dv,
            buckets=LATENCY,
            registry=r,
        )
        self.inflight = Gauge(
            "ember_gateway_inflight_units", "In-flight model units", dv, registry=r
        )
        self.cost_per_success = Gauge(
            "ember_cost_per_success_replica_seconds",
            "Replica-seconds per 2xx answer",
            dv,
            registry=r,
        )
        self.rungs = Counter(
            "ember_ladder_rung", "Answers per degradation-ladder rung", [*dv, "rung"], registry=r
        )
        self.cache = Counter(
            "ember_response_cache",
            "Response cache outcomes (hit, coalesced, miss, stale)",
            ["tenant", "deployment", "outcome"],
            registry=r,
        )
        self.hedges = Counter(
            "ember_hedges", "Hedged requests sent and won", [*dv, "outcome"], registry=r
        )
        self.log_records = Gauge(
            "ember_prediction_log_records",
            "Prediction log records by fate (written, dropped, pending)",
            ["fate"],
            registry=r,
        )
        self.log_sink_errors = Gauge(
            "ember_prediction_log_sink_errors", "Failed prediction log flushes", registry=r
        )
        self.cache_errors = Gauge(
            "ember_response_cache_errors",
            "Response cache Redis errors (served as misses)",
            registry=r,
        )
        self.prediction_log: PredictionLog | None = None
        self.response_cache: ResponseCache | None = None
        self.successes: dict[tuple[str, str, str], int] = {}
        self.seconds: dict[tuple[str, str, str], float] = {}
        self.tenant_names: dict[int, str] = {}
        """Tenant id -> name, refreshed by the controller with each registry read."""
        self._last = time.monotonic()

    def tenant(self, tenant_id: int) -> str:
        """The ``tenant`` label of a tenant id: its name (``#<id>`` while it is not known,
        which no tenant name can be)."""
        if not tenant_id:
            return NO_TENANT
        return self.tenant_names.get(tenant_id) or f"#{tenant_id}"

    def of(self, view: DeploymentView) -> tuple[str, str]:
        """The ``tenant`` and ``deployment`` labels of a deployment."""
        return self.tenant(view.tenant_id), view.name

    def request(self, view: DeploymentView, version: str, outcome: str) -> None:
        """One gateway outcome (``ok``, ``retried``, ``shed``) of ``view``'s ``version``."""
        self.requests.labels(*self.of(view), version, outcome).inc()

    def cached(self, view: DeploymentView, outcome: str) -> None:
        self.cache.labels(*self.of(view), outcome).inc()

    def hedged(self, view: DeploymentView, version: str, outcome: str) -> None:
        self.hedges.labels(*self.of(view), version, outcome).inc()

    def observe(self, controller: PoolsController) -> None:
        now = time.monotonic()
        dt, self._last = now - self._last, now
        self.replicas.clear()
        counts: dict[tuple[str, str, str, str, str], int] = {}
        for replica in controller.replicas.values():
            tenant = self.tenant(replica.key[0])
            name = replica.key[1] or "(standby)"
            state = "queued" if replica.queued else replica.state
            labels = (tenant, name, replica.version or "-", state, replica.tier)
            counts[labels] = counts.get(labels, 0) + 1
            self.replica_seconds.labels(tenant, name, replica.version or "-", replica.tier).inc(dt)
            key = (tenant, name, replica.version or "-")
            self.seconds[key] = self.seconds.get(key, 0.0) + dt
        for labels, n in counts.items():
            self.replicas.labels(*labels).set(n)
        for key, ok in self.successes.items():
            if ok:
                self.cost_per_success.labels(*key).set(self.seconds.get(key, 0.0) / ok)

    def success(self, tenant: str, deployment: str, version: str) -> None:
        key = (tenant, deployment, version)
        self.successes[key] = self.successes.get(key, 0) + 1

    def render(self, tenant: str | None = None) -> bytes:
        """The exposition text: every series, or with ``tenant`` only that tenant's."""
        plog = self.prediction_log
        if plog is not None:
            self.log_records.labels("written").set(plog.written)
            self.log_records.labels("dropped").set(plog.dropped)
            self.log_records.labels("pending").set(plog.pending)
            self.log_sink_errors.set(plog.sink_errors)
        if self.response_cache is not None:
            self.cache_errors.set(self.response_cache.stats.errors)
        if tenant is None:
            return generate_latest(self.registry)
        only = CollectorRegistry(auto_describe=False)
        only.register(_OnlyTenant(self.registry, tenant))
        return generate_latest(only)
