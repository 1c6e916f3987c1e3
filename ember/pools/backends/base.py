"""The replica-backend interface. All process (or Kubernetes) calls are made here, not in
the controller, so a second backend only has to implement these few methods."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ember.domain.spec import VersionSpec, replica_auth

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ember.registry.schemas import Placement


@dataclass
class ReplicaHandle:
    """Where a replica runs. ``pid``/``port`` are the local backend's; others leave them."""

    replica_id: str
    url: str
    pid: int | None = None
    port: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    secret: str = field(default="", repr=False, compare=False)
    """The replica API's secret (made at launch, ``secrets.token_urlsafe(32)``): every call
    but the probes sends it as ``REPLICA_SECRET_HEADER``. Never logged (not in ``repr``);
    empty for a replica that requires none."""

    @property
    def auth(self) -> dict[str, str]:
        """The headers that authenticate a call to this replica's API."""
        return replica_auth(self.secret)


@dataclass(frozen=True)
class LaunchOptions:
    max_batch_size: int = 32
    max_queue_delay_ms: float = 5.0
    max_queue: int = 1024
    tenant_id: int = 0
    deployment: str = ""
    """The Ember deployment the replica serves (cluster backends label and group by it)."""
    placement: Placement | None = None
    """The deployment's placement policy (GPU type, resources, threads); the local backend
    uses ``threads`` (a standby process gets them, with the batch policy, from the
    controller's ``/assign``) and the GPU count (``ember.pools.backends.local``)."""
    reserve_bytes: int = 0
    """A standby process: host memory to fault in ahead for the weights it may be given
    (``HostReserve``); the local backend passes it, others ignore it."""

    def replica_settings(self) -> dict[str, Any]:
        """What a replica serves with, named as ``ember engine``'s options and ``POST
        /assign``'s query name them: the batch policy, and the placement's threads when
        it sets them (a replica started with them, or a standby process assigned them)."""
        settings: dict[str, Any] = {
            "max_batch_size": self.max_batch_size,
            "max_queue_delay_ms": self.max_queue_delay_ms,
            "max_queue": self.max_queue,
        }
        if self.placement is not None and self.placement.threads:
            settings["threads"] = self.placement.threads
        return settings


@dataclass
class ObservedReplica:
    """A replica that exists in the backend (found, not launched by this process): what a
    controller that takes over, or one that only follows, needs to know about it."""

    handle: ReplicaHandle
    tenant_id: int
    deployment: str
    """Empty for a standby replica."""
    model: str
    version: str
    ready: bool
    """The backend's own readiness signal (a pod's Ready condition)."""


class ReplicaBackend(ABC):
    replicas_outlive_controller = False
    """True where replicas keep running when the controller's process stops (a cluster):
    the controller then leaves them to its successor instead of stopping them."""

    @abstractmethod
    def launch(self, spec: VersionSpec | None, options: LaunchOptions) -> ReplicaHandle:
        """Start a replica for ``spec`` (its version), or a standby process (None).
        Returns at once; readiness is observed through the replica's ``/readyz``."""

    def standby_can_run(self, spec: VersionSpec) -> bool:
        """Whether a standby process (generic runtime) can take ``spec`` (its engine's
        runtime may live elsewhere, e.g. vLLM in its own environment)."""
        return True

    @abstractmethod
    def exited(self, handle: ReplicaHandle) -> int | None:
        """The exit status if the replica's process is gone, else None."""

    @abstractmethod
    def stop(self, handle: ReplicaHandle, grace_s: float = 10.0) -> None:
        """Stop gracefully (SIGTERM), then forcefully after ``grace_s``."""

    @abstractmethod
    def kill(self, handle: ReplicaHandle) -> None:
        """Stop at once (a hung replica gets no grace)."""

    def standby_can_take(
        self, handle: ReplicaHandle, spec: VersionSpec, options: LaunchOptions
    ) -> bool:
        """Whether this standby replica (``handle``) can be assigned ``spec``: the right
        runtime and, on a cluster, the right hardware and size."""
        return self.standby_can_run(spec)

    def assign_query(
        self, handle: ReplicaHandle, spec: VersionSpec, options: LaunchOptions
    ) -> dict[str, Any]:
        """What ``POST /assign`` adds to the query for this backend, besides the batch
        policy (the local backend: the tenant, and the uid the process drops to)."""
        return {}

    def assigned(self, handle: ReplicaHandle, spec: VersionSpec, options: LaunchOptions) -> None:
        """The controller gave standby ``handle`` a version (cluster backends relabel it)."""
        return None

    def waiting(self, handle: ReplicaHandle) -> str | None:
        """Why the replica has not started yet — queued for capacity the backend hands out
        itself, such as the local backend's GPUs — or None once it has (or never waited)."""
        return None

    def exit_reason(self, handle: ReplicaHandle) -> str | None:
        """Why the replica is gone, when the backend knows better than an exit status."""
        return None

    def observe(self) -> list[ObservedReplica]:
        """The replicas that exist now, whoever launched them (none on the local backend:
        its processes die with the controller)."""
        return []

    def adopt(self) -> list[ObservedReplica]:
        """This controller was elected: act for the replicas that exist now (it launched
        none of them) and return them, as ``observe`` would."""
        return self.observe()

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Add the backend's own metrics to the controller's registry."""
        return None

    def close(self) -> None:
        """Release what the backend holds: threads and connections (a cluster's replicas
        stay), the local backend's processes."""
        return None
