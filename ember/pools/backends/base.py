"""The replica-backend interface. All process (or Kubernetes) calls are made here, not in
the controller, so a second backend only has to implement these few methods."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReplicaHandle:
    """Where a replica runs. ``pid``/``port`` are the local backend's; others leave them."""

    replica_id: str
    url: str
    pid: int | None = None
    port: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchOptions:
    max_batch_size: int = 32
    max_queue_delay_ms: float = 5.0
    max_queue: int = 1024


class ReplicaBackend(ABC):
    @abstractmethod
    def launch(self, spec: dict[str, Any] | None, options: LaunchOptions) -> ReplicaHandle:
        """Start a replica for ``spec`` (a VersionSpec dict), or a standby process (None).
        Returns at once; readiness is observed through the replica's ``/readyz``."""

    def standby_can_run(self, spec: dict[str, Any]) -> bool:
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
