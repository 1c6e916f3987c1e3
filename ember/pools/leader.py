"""Which API replica's pools controller acts: leader election over a Kubernetes Lease
(``coordination.k8s.io/v1``), as client-go's ``leaderelection`` does it.

The holder renews the Lease every third of its duration. Another candidate takes it over
only after it has seen the same Lease record (holder, renew time) unchanged for a whole
duration, measured on its own monotonic clock — wall clocks of different nodes are never
compared. A holder that cannot renew stops acting after two thirds of the duration, before
anyone may take over. Writes carry the read ``resourceVersion``, so of two candidates that
race for an expired Lease the API server lets one win (409 for the other). On a clean
shutdown the holder releases the Lease so that a successor takes over at once.

Only the acting controller launches, stops and scales replicas; the others keep their
routing tables from the replicas they observe (see ``PoolsController``).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ember.logs import get_logger

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

    from ember.config import Settings
    from ember.pools.backends.base import ReplicaBackend

log = get_logger(__name__)


def _micro_time(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElection:
    def __init__(
        self,
        client: ApiClient,
        namespace: str,
        name: str,
        *,
        identity: str | None = None,
        duration_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from kubernetes import client as k8s

        self.api = k8s.CoordinationV1Api(client)
        self.namespace = namespace
        self.name = name
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.duration_s = duration_s
        self.renew_every_s = duration_s / 3
        self.clock = clock
        self._leading_until = -math.inf
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = -math.inf

    @property
    def is_leader(self) -> bool:
        return self.clock() < self._leading_until

    def manifest(self, transitions: int = 0) -> dict[str, Any]:
        """The Lease this candidate writes when it takes or renews leadership."""
        now = _micro_time(datetime.now(UTC))
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {"app.kubernetes.io/managed-by": "ember-pools"},
            },
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": max(1, round(self.duration_s)),
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": transitions,
            },
        }

    def step(self) -> bool:
        """Take or renew the Lease once; whether this candidate leads now. An API error
        keeps the current answer until the renew deadline passes."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self._step()
        except ApiException as exc:
            if exc.status == 409:  # another candidate wrote first
                self._leading_until = -math.inf
                return False
            log.warning("lease call failed", lease=self.name, status=exc.status, reason=exc.reason)
        except Exception as exc:  # connection errors: keep leading until the deadline
            log.warning("lease call failed", lease=self.name, error=str(exc))
        return self.is_leader

    def _step(self) -> bool:
        from kubernetes.client.exceptions import ApiException

        now = self.clock()
        try:
            raw = self.api.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.api.create_namespaced_lease(self.namespace, self.manifest())
            return self._won(now, taken=True)
        lease = json.loads(raw.data)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        record = (holder, spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = float(spec.get("leaseDurationSeconds") or self.duration_s)
        if holder and holder != self.identity and now - self._observed_at < duration:
            self._leading_until = -math.inf
            return False
        taken = holder != self.identity
        body = self.manifest(int(spec.get("leaseTransitions") or 0) + (1 if taken else 0))
        if not taken and spec.get("acquireTime"):
            body["spec"]["acquireTime"] = spec["acquireTime"]
        version = (lease.get("metadata") or {}).get("resourceVersion")
        patch = {"metadata": {"resourceVersion": version}, "spec": body["spec"]}
        if version is None:
            del patch["metadata"]
        self.api.patch_namespaced_lease(self.name, self.namespace, patch)
        return self._won(now, taken)

    def _won(self, now: float, taken: bool) -> bool:
        if taken:
            log.info("pools controller leadership taken", lease=self.name, holder=self.identity)
        self._leading_until = now + self.duration_s * 2 / 3
        return True

    def release(self) -> None:
        """Give the Lease up (clean shutdown) so that a successor need not wait it out."""
        if not self.is_leader:
            return
        self._leading_until = -math.inf
        try:
            body = {"spec": {"holderIdentity": None, "leaseDurationSeconds": 1}}
            self.api.patch_namespaced_lease(self.name, self.namespace, body)
        except Exception as exc:  # the Lease then expires by itself
            log.warning("lease release failed", lease=self.name, error=str(exc))


def election_for(settings: Settings, backend: ReplicaBackend) -> LeaseElection | None:
    """The Lease election of a cluster backend; None where one controller is all there is."""
    client = getattr(backend, "client", None)
    if settings.replica_backend != "kubernetes" or client is None:
        return None
    return LeaseElection(
        client,
        settings.k8s_namespace,
        settings.k8s_lease_name,
        duration_s=settings.k8s_lease_duration_s,
    )
