"""The online path: admission → router → replica, with retries inside a budget.

Predict is idempotent, so a request whose replica died (connection refused or reset) or
shed it (429/503) is tried once more on another replica if the retry budget allows.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from ember.engine.spec import Priority
from ember.errors import BackPressure, EngineError, NotFound, NotReady, Upstream
from ember.logs import get_logger, model_context
from ember.pools.admission import Admission
from ember.pools.controller import DeploymentView, PoolsController
from ember.pools.router import (
    RetryBudget,
    pick_replica,
    pick_version,
    record_failure,
    record_success,
)

log = get_logger(__name__)
RETRYABLE_STATUS = {429, 503}
QUEUE_BATCHES = 4


@dataclass
class Prediction:
    body: dict[str, Any]
    version: str
    replica_id: str
    deployment: str
    attempts: int
    rung: str = "model"
    """Which rung of the degradation ladder answered: model | cache | fallback | default."""
    cache: str = "off"
    """Response cache outcome: hit | miss | off."""


class Gateway:
    def __init__(
        self, controller: PoolsController, admission: Admission, retry_ratio: float
    ) -> None:
        self.controller = controller
        self.admission = admission
        self.budget = RetryBudget(ratio=retry_ratio)
        self.http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200)
        )
        self.rng = random.Random()

    def deployment_for(self, tenant_id: int, model: str) -> DeploymentView:
        """The deployment serving ``model``: the one named after it, else any of it (from
        the controller's view of the registry: no database read on the hot path)."""
        deployments = self.controller.deployments
        view = deployments.get((tenant_id, model))
        if view is not None and view.model == model:
            return view
        serving = sorted(
            n for (t, n), v in deployments.items() if t == tenant_id and v.model == model
        )
        if serving:
            return deployments[(tenant_id, serving[0])]
        raise NotFound(f"no deployment serves model {model!r}", model=model)

    async def predict(
        self,
        view: DeploymentView,
        tenant: str,
        instances: list[Any],
        priority: Priority,
        timeout_ms: float,
        session_key: str | None = None,
        version: str | None = None,
    ) -> Prediction:
        started = time.monotonic()
        deadline = started + timeout_ms / 1000
        key = (view.tenant_id, view.name)
        if version is not None and version not in view.specs:
            raise NotFound(f"version {version!r} is not served by deployment {view.name!r}")
        traffic = {version: 1} if version else self.controller.routable_traffic(view)
        chosen = pick_version(traffic, self.rng)
        cost = view.cost(chosen)
        units = cost.cost(1) * len(instances)
        routes = self.controller.routes(key, chosen)
        if not routes:
            raise NotReady(
                f"version {chosen!r} of {view.name!r} has no ready replica", version=chosen
            )
        inflight = sum(r.inflight_units for r in routes)
        capacity = len(routes) * view.policy.max_batch_size * cost.cost(1)
        calibrated = bool(view.specs.get(chosen, {}).get("cost"))
        per_s = len(routes) * cost.capacity_units_per_s if calibrated else float("inf")
        try:
            self.admission.admit(
                tenant, units, priority, inflight, capacity, per_s, timeout_ms / 1000
            )
        except BackPressure:
            self.controller.metrics.requests.labels(view.name, chosen, "shed").inc()
            self.controller.record_demand(key, chosen, units, admitted=False)
            raise
        self.controller.record_demand(key, chosen, units, admitted=True)
        self.budget.deposit()
        attempts = 0
        tried: set[str] = set()
        with model_context(view.model, chosen, deployment=view.name):
            while True:
                attempts += 1
                candidates = [
                    r for r in self.controller.routes(key, chosen) if r.replica_id not in tried
                ]
                if not candidates:
                    raise NotReady(f"no ready replica of {view.name}:{chosen} left to try")
                # Bounded queues: at most QUEUE_BATCHES batches wait ahead of each replica.
                per_replica = QUEUE_BATCHES * view.policy.max_batch_size * cost.cost(1)
                candidates = [r for r in candidates if r.inflight_units + units <= per_replica]
                if not candidates:
                    self.controller.metrics.requests.labels(view.name, chosen, "shed").inc()
                    batch_s = view.policy.max_queue_delay_ms / 1000 + cost.service_s(1)
                    raise BackPressure(
                        f"every replica of {view.name}:{chosen} has {QUEUE_BATCHES} batches queued",
                        retry_after_s=max(1.0, QUEUE_BATCHES * batch_s),
                        version=chosen,
                    )
                route = pick_replica(candidates, session_key)
                tried.add(route.replica_id)
                remaining_ms = (deadline - time.monotonic()) * 1000
                route.inflight_units += units
                try:
                    response = await self.http.post(
                        f"{route.url}/infer",
                        json={"instances": instances, "timeout_ms": max(1.0, remaining_ms)},
                        headers={"X-Ember-Priority": priority.label},
                        timeout=max(0.001, remaining_ms / 1000) + 1.0,
                    )
                except httpx.TransportError as exc:
                    record_failure(route)
                    if time.monotonic() < deadline and self.budget.try_withdraw():
                        self.controller.metrics.requests.labels(view.name, chosen, "retried").inc()
                        log.warning(
                            "replica unreachable, retrying",
                            replica_id=route.replica_id,
                            error=type(exc).__name__,
                        )
                        continue
                    raise EngineError(
                        f"replica {route.replica_id} failed: {type(exc).__name__}"
                    ) from exc
                finally:
                    route.inflight_units -= units
                if (
                    response.status_code in RETRYABLE_STATUS
                    and time.monotonic() < deadline
                    and self.budget.try_withdraw()
                ):
                    self.controller.metrics.requests.labels(view.name, chosen, "retried").inc()
                    continue
                if response.status_code != 200:
                    if response.status_code >= 500:
                        record_failure(route)
                    raise _passthrough(response)
                record_success(route)
                self.controller.mark_ok(route.replica_id)
                self.controller.metrics.requests.labels(view.name, chosen, "ok").inc()
                self.controller.metrics.success(view.name, chosen)
                self.controller.metrics.latency.labels(view.name, chosen).observe(
                    time.monotonic() - started
                )
                return Prediction(response.json(), chosen, route.replica_id, view.name, attempts)

    async def close(self) -> None:
        await self.http.aclose()


def _passthrough(response: httpx.Response) -> Upstream:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {
            "type": "about:blank",
            "title": "Replica error",
            "status": response.status_code,
            "detail": response.text[:500],
        }
    return Upstream(response.status_code, body, response.headers.get("retry-after"))
