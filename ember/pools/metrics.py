"""Prometheus metrics of the pools and the gateway, per tenant, deployment, model and
version (every series: docs/reference/metrics.md).

Every series about a tenant's deployment carries a ``tenant`` label (the tenant's name;
``-`` for standby processes, which belong to no tenant yet): ``render(tenant=...)``
gives a tenant only its own series, the API's ``/metrics`` does that for tenant keys.
Cost per success (``ember_cost_*``) is read at scrape time from the shared ledger
(``ember.pools.costs``): the same figures on every API process."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ember.logs import get_logger
from ember.pools.costs import WINDOWS, CostLedger

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from ember.pools.inventory import ManagedReplica
    from ember.serving.cache import ResponseCache
    from ember.serving.predlog import PredictionLog
    from ember.serving.routing import DeploymentView

log = get_logger(__name__)

LATENCY = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
STARTUP = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
NO_TENANT = "-"
"""The ``tenant`` label of what belongs to no tenant (standby processes)."""
STANDBY_DEPLOYMENT = "(standby)"
"""The ``deployment`` label of a standby process (no deployment yet)."""


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


class _Totals:
    """Running totals kept elsewhere (the prediction log, the response cache), exposed as
    counters when scraped."""

    def __init__(self, metrics: PoolMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        plog = self.metrics.prediction_log
        if plog is not None:
            records = CounterMetricFamily(
                "ember_prediction_log_records",
                "Prediction log records by fate (written, dropped)",
                labels=["fate"],
            )
            records.add_metric(["written"], plog.written)
            records.add_metric(["dropped"], plog.dropped)
            yield records
            yield GaugeMetricFamily(
                "ember_prediction_log_pending_records",
                "Prediction log records waiting to be written",
                value=plog.pending,
            )
            yield CounterMetricFamily(
                "ember_prediction_log_sink_errors", "Failed prediction log flushes",
                value=plog.sink_errors,
            )  # fmt: skip
        if self.metrics.response_cache is not None:
            yield CounterMetricFamily(
                "ember_response_cache_errors",
                "Response cache Redis errors (served as misses)",
                value=self.metrics.response_cache.stats.errors,
            )


class _Costs:
    """Cost per success from the shared ledger: the same on every API process (so sum
    nothing over API processes: take ``max`` or any one)."""

    def __init__(self, metrics: PoolMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        try:
            snapshot = m.costs.snapshot()
        except Exception as exc:  # Redis away: no cost series this scrape
            log.warning("could not read the cost counts", error=str(exc))
            return
        dv = ["tenant", "deployment", "model", "version"]
        ratio = GaugeMetricFamily(
            "ember_cost_per_success_replica_seconds",
            "Replica-seconds (own tiers plus the apportioned standby share) per 2xx answer, "
            "over a window (5m, 1h, 24h) or the lifetime; platform-wide",
            labels=[*dv, "window"],
        )
        seconds = CounterMetricFamily(
            "ember_cost_replica_seconds",
            "Replica-seconds per tier counted by the acting controller; platform-wide "
            "(standby processes: tenant -, deployment (standby))",
            labels=[*dv, "tier"],
        )
        successes = CounterMetricFamily(
            "ember_cost_successes",
            "2xx answers sent by every API process; platform-wide",
            labels=dv,
        )
        starts = CounterMetricFamily(
            "ember_cost_standby_starts",
            "Starts served by a standby process, which apportion its replica-seconds",
            labels=dv,
        )
        life = snapshot.lifetime
        for (t, d, model, v, tier), s in sorted(life.seconds.items()):
            seconds.add_metric([m.tenant(t), d or STANDBY_DEPLOYMENT, model, v, tier], s)
        for key in sorted(snapshot.versions()):
            labels = [m.tenant(key[0]), key[1], key[2], key[3]]
            if key in life.successes:
                successes.add_metric(labels, life.successes[key])
            if key in life.starts:
                starts.add_metric(labels, life.starts[key])
            figures = {w: snapshot.windows[w].per_success(key) for w in WINDOWS}
            figures["lifetime"] = life.per_success(key)
            for window, value in figures.items():
                if value is not None:
                    ratio.add_metric([*labels, window], value)
        yield from (ratio, seconds, successes, starts)


class PoolMetrics:
    """The pools' and the gateway's series. Running totals are counters (``_total`` in the
    exposition), durations in seconds; every series about a deployment carries ``tenant``,
    ``deployment``, ``model`` and ``version`` (positional order: ``labels(*of(view),
    version, ...)``). Cost per success comes from the shared ``CostLedger``
    (``ember.pools.costs``): the same figure on every API process."""

    def __init__(self, costs: CostLedger | None = None) -> None:
        r = self.registry = CollectorRegistry()
        dv = ["tenant", "deployment", "model", "version"]
        self.replicas = Gauge(
            "ember_replicas", "Replicas by state and tier", [*dv, "state", "tier"], registry=r
        )
        self.replica_seconds = Counter(
            "ember_replica_seconds",
            "Replica-seconds alive per tier, counted by the controller that acts (the leader)",
            [*dv, "tier"],
            registry=r,
        )
        self.cold_start = Histogram(
            "ember_cold_start_seconds",
            "Launch (or standby assignment) to ready",
            dv,
            buckets=STARTUP,
            registry=r,
        )
        self.replaced = Counter(
            "ember_replicas_replaced", "Replicas replaced", [*dv, "reason"], registry=r
        )
        self.detect_seconds = Histogram(
            "ember_unhealthy_detect_seconds",
            "Last good answer to kill",
            dv,
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
        self.rungs = Counter(
            "ember_ladder_rung", "Answers per degradation-ladder rung", [*dv, "rung"], registry=r
        )
        self.cache = Counter(
            "ember_response_cache",
            "Response cache outcomes (hit, coalesced, miss, stale)",
            ["tenant", "deployment", "model", "outcome"],
            registry=r,
        )
        self.hedges = Counter(
            "ember_hedges", "Hedged requests sent and won", [*dv, "outcome"], registry=r
        )
        self.prediction_log: PredictionLog | None = None
        self.response_cache: ResponseCache | None = None
        self.costs = costs or CostLedger()
        r.register(_Totals(self))
        r.register(_Costs(self))
        self._tenant_names: dict[int, str] = {}
        self._tenant_ids: dict[str, int] = {}
        self._counted: dict[str, float] = {}
        """Replica id -> the monotonic time its replica-seconds were counted up to."""
        self._starts_counted: set[str] = set()
        """Replicas (assigned standby processes) whose start was counted for the ledger."""
        self._answers: dict[tuple[str, ...], list[Any]] = {}
        """(tenant, deployment, model, version) -> the ``ok`` counter, latency and queue
        time children ``answered`` touches: bound once, not three ``labels()`` lookups on
        every answer's path (these series are never removed)."""

    def use_costs(self, costs: CostLedger) -> None:
        """Share cost counts through ``costs`` (a Redis-backed ledger) from now on."""
        old, self.costs = self.costs, costs
        old.close()
        costs.start()

    def close(self) -> None:
        self.costs.close()

    @property
    def tenant_names(self) -> dict[int, str]:
        """Tenant id -> name, refreshed by the controller with each registry read."""
        return self._tenant_names

    @tenant_names.setter
    def tenant_names(self, names: dict[int, str]) -> None:
        self._tenant_names = names
        self._tenant_ids = {name: i for i, name in names.items()}

    def tenant(self, tenant_id: int) -> str:
        """The ``tenant`` label of a tenant id: its name (``#<id>`` while it is not known,
        which no tenant name can be)."""
        if not tenant_id:
            return NO_TENANT
        return self.tenant_names.get(tenant_id) or f"#{tenant_id}"

    def of(self, view: DeploymentView) -> tuple[str, str, str]:
        """The ``tenant``, ``deployment`` and ``model`` labels of a deployment."""
        return self.tenant(view.tenant_id), view.name, view.model

    def of_replica(self, replica: ManagedReplica) -> tuple[str, str, str, str]:
        """The ``tenant``, ``deployment``, ``model`` and ``version`` labels of a replica
        (a standby process: ``-``, ``(standby)``, ``-``, ``-``)."""
        name = STANDBY_DEPLOYMENT if replica.key.standby_pool else replica.key.name
        return self.tenant(replica.key[0]), name, replica.model or "-", replica.version or "-"

    def attach(self, predictions: PredictionLog, cache: ResponseCache | None) -> None:
        """The gateway's prediction log and response cache, whose totals are scraped."""
        self.prediction_log, self.response_cache = predictions, cache

    def answered(
        self, view: DeploymentView, version: str, latency_s: float, queue_s: float | None = None
    ) -> None:
        """One answer from a replica: an ``ok`` outcome, a success (cost per success), its
        end-to-end latency and, where the replica reported it, its time in the queue."""
        key = (*self.of(view), version)
        children = self._answers.get(key)
        if children is None:
            children = self._answers[key] = [
                self.requests.labels(*key, "ok"),
                self.latency.labels(*key),
                None,  # the queue series appears with the first queue time reported
            ]
        children[0].inc()
        self.success(*key)
        children[1].observe(latency_s)
        if queue_s is not None:
            if children[2] is None:
                children[2] = self.queue_time.labels(*key)
            children[2].observe(queue_s)

    def rung(self, view: DeploymentView, version: str, rung: str) -> None:
        """One answer from a rung of the degradation ladder."""
        self.rungs.labels(*self.of(view), version, rung).inc()

    def request(self, view: DeploymentView, version: str, outcome: str) -> None:
        """One gateway outcome (``ok``, ``retried``, ``shed``) of ``view``'s ``version``."""
        self.requests.labels(*self.of(view), version, outcome).inc()

    def cached(self, view: DeploymentView, outcome: str) -> None:
        self.cache.labels(*self.of(view), outcome).inc()

    def hedged(self, view: DeploymentView, version: str, outcome: str) -> None:
        self.hedges.labels(*self.of(view), version, outcome).inc()

    def observe(self, replicas: Iterable[ManagedReplica], *, leading: bool) -> None:
        """The replica gauges of every tracked replica; and, ``leading`` (on the controller
        that acts), the replica-seconds of each since it was last counted (from its start,
        or the last tick this controller followed: the leader then counted them), and the
        standby starts."""
        now = time.monotonic()
        self.replicas.clear()
        counts: dict[tuple[str, ...], int] = {}
        seen: dict[str, float] = {}
        for replica in replicas:
            labels = self.of_replica(replica)
            state = "queued" if replica.queued else replica.state
            row = (*labels, state, replica.tier)
            counts[row] = counts.get(row, 0) + 1
            rid = replica.handle.replica_id
            since = max(self._counted.get(rid, replica.started_at), replica.started_at)
            seen[rid] = now
            if not leading:  # a follower: the leader counts up to now
                continue
            seconds = max(0.0, now - since)
            key = (replica.key[0], replica.key[1], replica.model or "-", replica.version or "-")
            self.replica_seconds.labels(*labels, replica.tier).inc(seconds)
            self.costs.add_seconds((*key, replica.tier), seconds)
            served = (
                replica.source != "cold" and not replica.adopted and not replica.key.standby_pool
            )
            if served and rid not in self._starts_counted:
                self._starts_counted.add(rid)
                self.costs.add_standby_start(key)
        self._counted = seen
        self._starts_counted &= set(seen)
        for row_labels, n in counts.items():
            self.replicas.labels(*row_labels).set(n)

    def success(self, tenant: str, deployment: str, model: str, version: str) -> None:
        """One 2xx answer (the gateway's), for cost per success."""
        tenant_id = self.tenant_id(tenant)
        self.costs.add_success((tenant_id, deployment, model, version))

    def tenant_id(self, tenant: str) -> int:
        """The tenant id of a ``tenant`` label (0: none, a standby process)."""
        if tenant.startswith("#"):
            return int(tenant[1:])
        return self._tenant_ids.get(tenant, 0)

    def render(self, tenant: str | None = None) -> bytes:
        """The exposition text: every series, or with ``tenant`` only that tenant's."""
        if tenant is None:
            return generate_latest(self.registry)
        only = CollectorRegistry(auto_describe=False)
        only.register(_OnlyTenant(self.registry, tenant))
        return generate_latest(only)
