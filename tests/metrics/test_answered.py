"""The gateway's answer series (``PoolMetrics.answered``): each (tenant, deployment, model,
version) counts into its own series, however often it answers and in whatever order."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ember.pools.metrics import PoolMetrics
from ember.registry.schemas import PoolPolicy
from ember.serving.routing import DeploymentView


def _samples(metrics: PoolMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def test_each_deployment_and_version_answers_into_its_own_series() -> None:
    metrics = PoolMetrics()
    metrics.tenant_names = {1: "acme", 2: "globex"}
    mine = DeploymentView(1, "mlp", "mlp", {"1": 50, "2": 50}, PoolPolicy(), {}, [])
    theirs = DeploymentView(2, "mlp", "mlp", {"1": 100}, PoolPolicy(), {}, [])
    for view, version, queue_s in [(mine, "1", 0.01), (mine, "2", None), (mine, "1", 0.03),
                                   (theirs, "1", 0.02)]:  # fmt: skip
        metrics.answered(view, version, 0.05, queue_s)
    metrics.tenant_names = {1: "acme-renamed", 2: "globex"}  # the label follows the name
    metrics.answered(mine, "1", 0.05, None)
    got = _samples(metrics)

    def series(name: str, tenant: str, version: str, **extra: str) -> float | None:
        labels = {"tenant": tenant, "deployment": "mlp", "model": "mlp", "version": version}
        return got.get((name, tuple(sorted((labels | extra).items()))))

    ok = {"outcome": "ok"}
    assert series("ember_gateway_requests_total", "acme", "1", **ok) == 2
    assert series("ember_gateway_requests_total", "acme", "2", **ok) == 1
    assert series("ember_gateway_requests_total", "globex", "1", **ok) == 1
    assert series("ember_gateway_requests_total", "acme-renamed", "1", **ok) == 1
    assert series("ember_gateway_latency_seconds_count", "acme", "1") == 2
    assert series("ember_gateway_queue_seconds_count", "acme", "1") == 2
    assert series("ember_gateway_queue_seconds_sum", "acme", "1") == 0.04
    assert series("ember_gateway_queue_seconds_count", "acme", "2") is None  # none reported
    assert series("ember_gateway_queue_seconds_count", "globex", "1") == 1
