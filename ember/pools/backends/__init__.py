"""Replica backends: every process / Kubernetes side effect goes through one of these."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.config import Settings
    from ember.pools.backends.base import ReplicaBackend


def create_backend(settings: Settings) -> ReplicaBackend:
    """The backend ``EMBER_REPLICA_BACKEND`` names (the Kubernetes client is imported only
    when it is the one)."""
    if settings.replica_backend == "kubernetes":
        from ember.pools.backends.kubernetes import KubernetesBackend

        return KubernetesBackend(settings)
    from ember.pools.backends.local import LocalProcessBackend

    return LocalProcessBackend(settings)


def standby_pool(settings: Settings) -> tuple[int, int]:
    """Standby replicas the controller keeps at least and at most:
    ``EMBER_STANDBY_REPLICAS`` and ``EMBER_STANDBY_MAX_REPLICAS``, per hardware type on
    Kubernetes."""
    kinds = 1
    if settings.replica_backend == "kubernetes":
        kinds = max(1, len(settings.k8s_standby_accelerators))
    floor = settings.standby_replicas * kinds
    return floor, max(floor, settings.standby_max_replicas * kinds)
