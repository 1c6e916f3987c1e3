"""Replica pods trace like the API when it does: the ``EMBER_OTEL_*`` settings travel in
the pod's environment, the collector's headers (a secret) never do."""

from __future__ import annotations

from ember.config import Settings
from ember.pools.backends import k8s_manifests as m


def test_replica_pods_inherit_tracing_but_never_the_collector_key() -> None:
    off = Settings()
    assert m.tracing_env(off) == ()
    on = Settings(
        otel_endpoint="http://collector.monitoring:4318",
        otel_headers="authorization=Bearer s3cret",  # type: ignore[arg-type]
        otel_sample_ratio=0.25,
        otel_service_name="ember-prod",
    )
    env = dict(m.tracing_env(on))
    assert env["EMBER_OTEL_ENDPOINT"] == "http://collector.monitoring:4318"
    assert env["EMBER_OTEL_SAMPLE_RATIO"] == "0.25"
    assert env["EMBER_OTEL_SERVICE_NAME"] == "ember-prod"
    assert "EMBER_OTEL_HEADERS" not in env
    assert "s3cret" not in repr(m.tracing_env(on))
