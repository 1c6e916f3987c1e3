"""The interface between control and serving: a routing table and a demand sink.

The control side (the pools controller) *publishes*: for every (deployment, version) an
immutable tuple of the routable routes (hot, ready replicas), swapped whole when it
changes, so a request finds its replicas with one dictionary look-up — O(1) in the number
of replicas, never a scan of every replica. The serving side *reports*: what arrived and
was admitted (demand, in model units), which replica answered well (an outcome that
spares it a probe), and that it wants a version served (a wake-up of a scaled-to-zero
deployment). In-flight units are counted here, on the :class:`Route` the serving side
owns; the controller reads them through :meth:`RoutingTable.inflight_units`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ember.costmodel import CostModel
from ember.domain.spec import DeploymentKey, VersionSpec
from ember.registry.schemas import PoolPolicy
from ember.serving.router import Route

if TYPE_CHECKING:
    from ember.serving.cache import ResponseCache
    from ember.serving.predlog import PredictionLog


@dataclass
class DeploymentView:
    tenant_id: int
    name: str
    model: str
    traffic: dict[str, int]
    policy: PoolPolicy
    specs: dict[str, VersionSpec]
    fallback: list[str]
    pinned: list[str] = field(default_factory=list)
    """Versions that running batch runs were pinned to: served (one hot replica each)
    until those runs end, even after a promote moved the traffic elsewhere."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Artifact bytes per version (where known)."""

    _costs: dict[str, CostModel] = field(default_factory=dict, init=False, repr=False,
                                         compare=False)  # fmt: skip

    def cost(self, version: str) -> CostModel:
        """The version's cost model (made once per view: the gateway asks per request)."""
        model = self._costs.get(version)
        if model is None:
            spec = self.specs.get(version)
            model = spec.cost_model if spec is not None else CostModel.from_dict(None)
            self._costs[version] = model
        return model

    @property
    def key(self) -> DeploymentKey:
        return DeploymentKey(self.tenant_id, self.name)

    @property
    def production(self) -> str | None:
        """The version with the most traffic (ties: the highest name)."""
        live = [(w, v) for v, w in self.traffic.items() if w > 0 and v in self.specs]
        return max(live)[1] if live else None

    def capacity_units_per_s(self, version: str) -> float:
        """One hot replica's throughput: calibrated, else assume a full batch per second."""
        spec = self.specs.get(version)
        if spec is not None and spec.cost:
            return self.cost(version).capacity_units_per_s
        return float(self.policy.max_batch_size) * self.cost(version).cost(1)


LaneKey = tuple[DeploymentKey, str]
"""(deployment, version): one lane of the routing table."""


@dataclass(frozen=True, slots=True)
class Lane:
    """A version's routable replicas (a snapshot: replaced, never changed) and whether a
    hot replica is on its way (starting, assigned, being promoted, or a warm one)."""

    routes: tuple[Route, ...] = ()
    coming: bool = False


_EMPTY = Lane()


class RoutingTable:
    """What the control side publishes and the serving side reads per request."""

    def __init__(self) -> None:
        self._lanes: Mapping[LaneKey, Lane] = {}
        self._by_id: Mapping[str, Route] = {}

    def publish(self, lanes: Mapping[LaneKey, Lane], tracked: Iterable[Route] = ()) -> None:
        """Swap in a new table (the control side, after any change of what is routable).
        ``tracked``: every route the control side still holds, routable or not (a
        draining replica's in-flight units stay readable)."""
        by_id = {r.replica_id: r for r in tracked}
        for lane in lanes.values():
            by_id.update((r.replica_id, r) for r in lane.routes)
        self._lanes, self._by_id = dict(lanes), by_id

    def lane(self, key: tuple[int, str], version: str) -> Lane:
        return self._lanes.get((DeploymentKey(*key), version), _EMPTY)

    def routes(self, key: tuple[int, str], version: str) -> tuple[Route, ...]:
        """The version's routable replicas (O(1): one look-up)."""
        return self.lane(key, version).routes

    def inflight_units(self, replica_id: str) -> float:
        """Model units the serving side has in flight on the replica (0 if none known)."""
        route = self._by_id.get(replica_id)
        return route.inflight_units if route is not None else 0.0


class DemandSink(Protocol):
    """What the serving side reports to the control side (the autoscaler's input)."""

    def record_demand(
        self,
        key: tuple[int, str],
        version: str,
        units: float,
        admitted: bool,
        *,
        arrived: bool = True,
    ) -> None:
        """An arrival (admitted or shed) in model units, reported once; ``arrived=False``
        for the admission of a request whose arrival was reported already."""

    def mark_ok(self, replica_id: str) -> None:
        """A real request succeeded on the replica: no health probe needed for a while."""

    def wake(self, key: tuple[int, str], version: str) -> bool:
        """A request wants ``version`` and finds no routable replica: whether a hot one is
        on its way (a scale-to-zero deployment is woken: one starts at the next tick)."""


class ServingMetrics(Protocol):
    """The outcomes the serving side counts (the control side's metrics registry exposes
    them: ``ember.pools.metrics.PoolMetrics``; every series docs/reference/metrics.md)."""

    def attach(self, predictions: PredictionLog, cache: ResponseCache | None) -> None:
        """The prediction log and response cache whose running totals are scraped."""

    def answered(
        self, view: DeploymentView, version: str, latency_s: float, queue_s: float | None = None
    ) -> None:
        """A replica answered: end-to-end latency, and its queue time where it said."""

    def request(self, view: DeploymentView, version: str, outcome: str) -> None:
        """Another outcome of a request (``retried``, ``shed``)."""

    def rung(self, view: DeploymentView, version: str, rung: str) -> None:
        """An answer from a rung of the degradation ladder."""

    def cached(self, view: DeploymentView, outcome: str) -> None:
        """A response-cache outcome (``hit``, ``coalesced``, ``miss``, ``stale``)."""

    def hedged(self, view: DeploymentView, version: str, outcome: str) -> None:
        """A hedge ``sent`` or ``won``."""


class ControlPlane(DemandSink, Protocol):
    """Everything the serving side may see of the control side: the routing table, the
    registry's deployments (read-only), where outcomes are counted, and the demand sink."""

    @property
    def table(self) -> RoutingTable: ...

    @property
    def deployments(self) -> Mapping[DeploymentKey, DeploymentView]: ...

    @property
    def metrics(self) -> ServingMetrics: ...

    def routable_traffic(self, view: DeploymentView) -> dict[str, int]:
        """The deployment's weights over versions that have a routable replica."""
        ...
