"""The online path: admission → response cache → router → replica, down a degradation ladder.

Predict is idempotent, so a request whose replica died (connection refused or reset) or
shed it (429/503) is tried once more on another replica if the retry budget allows; with
``hedge`` on, a request still unanswered after the version's p95 latency gets a second copy
on another replica (from the same budget, never from its reserve) and the first answer wins.

When the model cannot answer — overloaded, past its deadline, failing or without a ready
replica — a deployment with a ladder degrades instead of failing, rung by rung:

1. ``model``: the routed version (a fresh response-cache hit also counts as this rung);
2. ``cache``: a cached answer of the same version, stale within ``cache_stale_s``;
3. ``fallback``: the deployment's fallback versions, in order;
4. ``default``: the deployment's ``safe_default`` value for every instance.

Bad input (4xx) never degrades. Every answer says its rung (``X-Ember-Rung``), the metrics
count each rung, and the prediction log records one line per prediction.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pydantic_core
import structlog

from ember import tracing
from ember.domain.spec import DeploymentKey, Priority
from ember.errors import (
    BackPressure,
    CapacityError,
    DeadlineExceeded,
    EmberError,
    EngineError,
    NotFound,
    NotReady,
    Upstream,
)
from ember.logs import get_logger, model_context
from ember.serving.admission import Admission, class_share
from ember.serving.cache import ResponseCache, cache_key, digest
from ember.serving.hop import HopAnswer, ReplicaClient, ReplicaUnreachable
from ember.serving.predlog import DEFERRED_DIGESTS, PredictionLog
from ember.serving.router import (
    RetryBudget,
    Route,
    pick_replica,
    pick_version,
    record_failure,
    record_success,
)
from ember.serving.routing import ControlPlane, DeploymentView
from ember.serving.stats import RequestStats
from ember.web.tensorbody import TIMEOUT_HEADER, TensorBody

log = get_logger(__name__)
Instances = list[Any] | TensorBody
"""JSON instances, or a tensor body (the batch lane) passed on to the replica as is."""
RETRYABLE_STATUS = {429, 503}
QUEUE_BATCHES = 4
HEDGE_MIN_SAMPLES = 20
HEDGE_WINDOW = 256
WAIT_POLL_S = 0.02
LANE_REFRESH_S = 1.0
"""How long a batch worker may use a ``batch_lane`` answer before asking again."""


@dataclass
class Prediction:
    parsed: dict[str, Any] | None
    """The answer, or None while only ``content`` (the replica's JSON bytes) is known."""
    version: str
    replica_id: str
    deployment: str
    attempts: int
    rung: str = "model"
    """Which rung of the degradation ladder answered: model | cache | fallback | default."""
    cache: str = "off"
    """Response cache outcome: hit | coalesced | miss | stale | off."""
    hedged: bool = False
    replica_ms: str | None = None
    """The replica's own time for the answer (its ``X-Ember-Replica-Ms``), when one answered."""
    timing: str | None = None
    """``Server-Timing`` of a replica's answer: ``gateway`` (``predict``, whole), ``admit``
    (the model rung until the answering hop went out: routes, admission, replica pick,
    retries), ``hop`` (that hop's round trip), then the replica's own parts
    (``ember.engine.server.server_timing``)."""
    content: bytes | None = None
    """The replica's answer as it came (``{"predictions", "model", "version"}``): routes that
    answer in that shape send these bytes on without decoding and re-encoding them."""

    @property
    def body(self) -> dict[str, Any]:
        if self.parsed is None:
            self.parsed = json.loads(self.content or b"{}")
        return self.parsed


def degradable(exc: BaseException) -> bool:
    """Failures of the model (not of the request) that the ladder may absorb."""
    if isinstance(exc, Upstream):
        return exc.upstream_status >= 500 or exc.upstream_status == 429
    return isinstance(exc, CapacityError | EngineError | DeadlineExceeded)


class LatencyWindow:
    """Recent model-rung latencies of one version; its p95 is when a hedge goes out."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=HEDGE_WINDOW)
        self._p95: float | None = None
        self._since = 0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self._since += 1
        if self._since >= 16:
            self._p95 = None

    def p95(self) -> float | None:
        if len(self.samples) < HEDGE_MIN_SAMPLES:
            return None
        if self._p95 is None:
            self._p95 = statistics.quantiles(self.samples, n=20)[-1]
            self._since = 0
        return self._p95


class Gateway:
    def __init__(
        self,
        control: ControlPlane,
        admission: Admission,
        retry_ratio: float,
        *,
        cache: ResponseCache | None = None,
        predictions: PredictionLog | None = None,
        ladder_reserve: float = 0.25,
    ) -> None:
        self.control = control
        """The control side, through the one interface serving may use (``ControlPlane``):
        its routing table, its deployments, the pools' metrics, the demand sink."""
        self.table = control.table
        self.admission = admission
        self.budget = RetryBudget(ratio=retry_ratio)
        # Streaming passthrough (OpenAI routes) uses httpx; the predict hop a lean keep-alive
        # client (ember.serving.hop: ~0.1 ms of CPU per request, aiohttp ~0.3-0.5, httpx ~2.9).
        self.http = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=1000, max_keepalive_connections=200, keepalive_expiry=3.0
            )
        )
        self.hop = ReplicaClient()
        self.rng = random.Random()
        self.cache = cache
        self.predictions = predictions or PredictionLog(None)
        self.ladder_reserve = ladder_reserve
        self.latency: dict[tuple[int, str, str], LatencyWindow] = {}
        self.answers = RequestStats()  # the dashboard's latency / errors / rungs per version
        control.metrics.attach(self.predictions, cache)

    def deployment_named(self, tenant_id: int, name: str) -> DeploymentView:
        """The deployment called ``name`` (whatever model it serves), else the one serving
        the model ``name`` (``deployment_for``): how the OpenAI routes, which list
        deployments as models, find what a client names."""
        view = self.control.deployments.get(DeploymentKey(tenant_id, name))
        return view if view is not None else self.deployment_for(tenant_id, name)

    def deployment_for(self, tenant_id: int, model: str) -> DeploymentView:
        """The deployment serving ``model``: the one named after it, else any of it (from
        the controller's view of the registry: no database read on the hot path)."""
        deployments = self.control.deployments
        view = deployments.get(DeploymentKey(tenant_id, model))
        if view is not None and view.model == model:
            return view
        serving = sorted(
            n for (t, n), v in deployments.items() if t == tenant_id and v.model == model
        )
        if serving:
            return deployments[DeploymentKey(tenant_id, serving[0])]
        raise NotFound(f"no deployment serves model {model!r}", model=model)

    # --- the ladder ---------------------------------------------------------------------------

    async def predict(
        self,
        view: DeploymentView,
        tenant: str,
        instances: Instances,
        priority: Priority,
        timeout_ms: float,
        session_key: str | None = None,
        version: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> Prediction:
        """Answer ``instances`` with the deployment (or one ``version`` of it).

        ``params`` are the request's parameters that shape the answer (generation settings):
        part of the cache key, never of the replica call.
        """
        started = time.monotonic()
        if version is not None and version not in view.specs:
            raise NotFound(f"version {version!r} is not served by deployment {view.name!r}")
        try:
            traffic = {version: 1} if version else self.control.routable_traffic(view)
            chosen = pick_version(traffic, self.rng)
        except NotReady:
            if view.production is None:
                raise
            # Nothing ready: the model rung waits for a replica on its way, or the ladder
            # answers at once.
            chosen = view.production
        policy = view.policy
        input_digest = None  # computed here only when the cache needs it, else by the log
        if self.cache is not None and (policy.cache_ttl_s > 0 or policy.cache_stale_s > 0):
            input_digest = _input_digest(instances, params)
        attributes = None
        if tracing.enabled:  # on the request's server span and the gateway's
            attributes = tracing.model_attributes(view.model, chosen, view.name)
            tracing.annotate(attributes)
        with (
            model_context(view.model, chosen, deployment=view.name),
            tracing.span("gateway", attributes) as traced,
        ):
            try:
                result = await self._ladder(
                    view,
                    tenant,
                    chosen,
                    instances,
                    priority,
                    started,
                    timeout_ms,
                    session_key,
                    input_digest,
                )
            except EmberError as exc:
                self._log(view, tenant, chosen, instances, None, started, input_digest, exc, params)
                raise
            if tracing.enabled:
                traced.set_attributes(_span_attributes(result))
            if result.timing is not None:
                whole = (time.monotonic() - started) * 1000
                result.timing = f"gateway;dur={whole:.3f}, {result.timing}"
            # The bookkeeping of an answer waits until it is on its way: the callback runs
            # on the loop's next turn, after the route has sent it, in this context (the
            # request id and model bindings of its log lines stay).
            asyncio.get_running_loop().call_soon(
                self._answered, view, tenant, chosen, instances, result, started,
                time.monotonic(), input_digest, params,
            )  # fmt: skip
            return result

    def _answered(
        self,
        view: DeploymentView,
        tenant: str,
        chosen: str,
        instances: Instances,
        result: Prediction,
        started: float,
        ended: float,
        input_digest: str | None,
        params: dict[str, Any] | None,
    ) -> None:
        self.control.metrics.rung(view, result.version, result.rung)
        self._log(
            view, tenant, chosen, instances, result, started, input_digest, None, params, ended
        )

    def _has_ladder(self, view: DeploymentView) -> bool:
        policy = view.policy
        return bool(
            (self.cache is not None and policy.cache_stale_s > 0)
            or any(v in view.specs for v in view.fallback)
            or policy.safe_default is not None
        )

    async def _ladder(
        self,
        view: DeploymentView,
        tenant: str,
        chosen: str,
        instances: Instances,
        priority: Priority,
        started: float,
        timeout_ms: float,
        session_key: str | None,
        input_digest: str | None,
    ) -> Prediction:
        policy = view.policy
        deadline = started + timeout_ms / 1000
        sha256 = spec.sha256 if (spec := view.specs.get(chosen)) else ""
        key = None
        if input_digest is not None:
            key = cache_key(view.tenant_id, view.model, chosen, sha256, input_digest)
        use_cache = key is not None and policy.cache_ttl_s > 0
        fallbacks = [v for v in view.fallback if v != chosen and v in view.specs]
        model_deadline = deadline
        if fallbacks:
            model_deadline = deadline - self.ladder_reserve * timeout_ms / 1000

        async def model() -> Prediction:
            return await self._model(
                view, tenant, chosen, instances, priority, model_deadline, session_key
            )

        try:
            if not use_cache:
                return await model()
            assert self.cache is not None and key is not None
            with tracing.span("cache") as looked:
                entry = await self.cache.get(key)
                looked.set_attribute("ember.cache", "miss" if entry is None else "found")
            if entry is not None and entry.fresh(time.time()):
                self.cache.stats.hits += 1
                self.control.metrics.cached(view, "hit")
                return Prediction(
                    None, chosen, "-", view.name, 0, cache="hit", content=entry.content
                )
            ran: list[Prediction] = []

            async def compute() -> bytes:
                ran.append(await model())
                return ran[0].content or json.dumps(ran[0].body).encode()

            body, shared = await self.cache.single_flight(
                key,
                compute,
                ttl_s=policy.cache_ttl_s,
                stale_s=policy.cache_stale_s,
                deadline=model_deadline,
            )
            outcome = "coalesced" if shared else "miss"
            self.control.metrics.cached(view, outcome)
            if ran:
                return replace(ran[0], cache=outcome)
            return Prediction(None, chosen, "-", view.name, 0, cache=outcome, content=body)
        except EmberError as exc:
            if not degradable(exc) or not self._has_ladder(view):
                raise
            log.warning("model rung failed, degrading", error=f"{exc.title}: {exc.detail}")
            return await self._degrade(
                view, chosen, instances, priority, deadline, key, fallbacks, exc, tenant
            )

    async def _degrade(
        self,
        view: DeploymentView,
        chosen: str,
        instances: Instances,
        priority: Priority,
        deadline: float,
        key: str | None,
        fallbacks: Iterable[str],
        failure: EmberError,
        tenant: str,
    ) -> Prediction:
        policy = view.policy
        if key is not None and self.cache is not None and policy.cache_stale_s > 0:
            entry = await self.cache.get(key)
            if entry is not None:
                self.cache.stats.stale_hits += 1
                fresh = entry.fresh(time.time())
                self.control.metrics.cached(view, "stale")
                return Prediction(
                    None,
                    chosen,
                    "-",
                    view.name,
                    0,
                    rung="cache",
                    cache="hit" if fresh else "stale",
                    content=entry.content,
                )
        for version in fallbacks:
            try:
                with model_context(view.model, version, deployment=view.name):
                    result = await self._model(
                        view, tenant, version, instances, priority, deadline, None, admit=False
                    )
                return replace(result, rung="fallback")
            except EmberError as exc:
                if not degradable(exc):
                    raise
                log.warning("fallback version failed", fallback=version, error=exc.title)
        if policy.safe_default is not None:
            body = {"predictions": [policy.safe_default] * len(instances)}
            return Prediction(body, chosen, "-", view.name, 0, rung="default")
        raise failure

    # --- the model rung ------------------------------------------------------------------------

    async def _model(
        self,
        view: DeploymentView,
        tenant: str,
        chosen: str,
        instances: Instances,
        priority: Priority,
        deadline: float,
        session_key: str | None,
        *,
        admit: bool = True,
    ) -> Prediction:
        started = time.monotonic()
        timeout_s = max(0.0, deadline - started)
        key = (view.tenant_id, view.name)
        cost = view.cost(chosen)
        units = cost.cost(1) * len(instances)
        metrics = self.control.metrics
        routes: Sequence[Route] = self.table.routes(key, chosen)
        waited = False  # its arrival reported already (while it waited for a replica)
        if not routes and admit and not self._has_ladder(view):
            with tracing.span("await replica"):
                routes, waited = await self._await_replica(key, chosen, units, deadline)
        if not routes:
            raise NotReady(
                f"version {chosen!r} of {view.name!r} has no ready replica", version=chosen
            )
        if admit:
            with tracing.span("admission"):
                self.admit(view, tenant, chosen, routes, units, priority, timeout_s,
                           arrived=not waited)  # fmt: skip
        self.budget.deposit()
        attempts = 0
        tried: set[str] = set()
        window = self.latency.get((view.tenant_id, view.name, chosen))
        if window is None:
            window = self.latency[(view.tenant_id, view.name, chosen)] = LatencyWindow()
        payload: dict[str, Any] = {"instances": instances, "timeout_ms": 0.0}
        headers = {"X-Ember-Priority": priority.label}
        while True:
            attempts += 1
            with tracing.span("route") as routed:
                candidates = self.candidates(view, chosen, units, tried)
                route = pick_replica(candidates, session_key)
                routed.set_attribute("ember.replica", route.replica_id)
            tried.add(route.replica_id)
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise DeadlineExceeded(
                    f"{view.name}:{chosen} did not answer within the deadline", version=chosen
                )
            payload["timeout_ms"] = max(1.0, remaining_s * 1000)
            hedge_after = window.p95() if view.policy.hedge else None
            hedged = False
            sent = time.monotonic()
            try:
                if hedge_after is not None and hedge_after < remaining_s:
                    others = [r for r in candidates if r is not route]
                    response, route, hedged = await self._hedged(
                        route,
                        others,
                        payload,
                        headers,
                        units,
                        remaining_s,
                        hedge_after,
                        view,
                        chosen,
                        tried,
                    )
                else:
                    response = await self._send(route, payload, headers, units, remaining_s)
            except TimeoutError as exc:
                record_failure(route)
                raise DeadlineExceeded(
                    f"replica {route.replica_id} did not answer within the deadline",
                    version=chosen,
                ) from exc
            except ReplicaUnreachable as exc:
                record_failure(route)
                if time.monotonic() < deadline and self.budget.try_withdraw():
                    metrics.request(view, chosen, "retried")
                    log.warning(
                        "replica unreachable, retrying",
                        replica_id=route.replica_id,
                        error=type(exc).__name__,
                    )
                    continue
                failed = f"replica {route.replica_id} failed: {type(exc).__name__}"
                raise EngineError(failed) from exc
            if (
                response.status_code in RETRYABLE_STATUS
                and time.monotonic() < deadline
                and self.budget.try_withdraw()
            ):
                metrics.request(view, chosen, "retried")
                continue
            if response.status_code != 200:
                if response.status_code >= 500:
                    record_failure(route)
                raise _passthrough(response)
            answered = time.monotonic()
            elapsed = answered - started
            asyncio.get_running_loop().call_soon(  # after the answer is sent, as above
                self._replica_answered, route, view, chosen, window, elapsed,
                response.headers.get("x-ember-queue-ms"),
            )  # fmt: skip
            return Prediction(
                None,
                chosen,
                route.replica_id,
                view.name,
                attempts,
                hedged=hedged,
                replica_ms=response.headers.get("x-ember-replica-ms"),
                timing=_hop_timing(started, sent, answered, response.headers.get("server-timing")),
                content=response.content,
            )

    def admit(
        self,
        view: DeploymentView,
        tenant: str,
        version: str,
        routes: Sequence[Route],
        units: float,
        priority: Priority,
        timeout_s: float,
        *,
        arrived: bool = True,
    ) -> None:
        """Admission of one request of ``units`` to ``version`` (tenant budget, the class's
        share of the replicas' queue, predicted wait); the demand is reported either way
        (its arrival only where not reported already: ``arrived``)."""
        key = (view.tenant_id, view.name)
        cost = view.cost(version)
        capacity = len(routes) * view.policy.max_batch_size * cost.cost(1)
        calibrated = bool((spec := view.specs.get(version)) and spec.cost)
        per_s = len(routes) * cost.capacity_units_per_s if calibrated else float("inf")
        inflight = sum(r.inflight_units for r in routes)
        try:
            self.admission.admit(
                tenant,
                units,
                priority,
                inflight,
                capacity,
                per_s,
                timeout_s,
                queue_units=QUEUE_BATCHES * capacity,
            )
        except BackPressure:
            self.control.metrics.request(view, version, "shed")
            self.control.record_demand(key, version, units, admitted=False, arrived=arrived)
            raise
        self.control.record_demand(key, version, units, admitted=True, arrived=arrived)

    def batch_window(self, view: DeploymentView, version: str) -> int:
        """Instances the batch class may have in flight to ``version`` at once: its share
        of the ready replicas' queues (``admit`` refuses beyond it; at least one full
        batch, which an idle pool always takes)."""
        routes = self.table.routes((view.tenant_id, view.name), version)
        queue = len(routes) * QUEUE_BATCHES * view.policy.max_batch_size
        return max(view.policy.max_batch_size, int(class_share(Priority.batch, queue)))

    def batch_lane(self, view: DeploymentView, version: str, sent: int) -> dict[str, Any]:
        """Where batch workers may send ``version``'s batches themselves: its ready hot
        replicas, each with the instances the batch class may keep in flight to it.
        ``sent``: instances the worker sent that way since it last asked, reported as
        admitted demand so the autoscaler sees batch work it never routed. With no
        replica ready, a replica of the version is asked for (``coming`` wakes a
        scale-to-zero deployment) and the list is empty: the worker sends through
        ``:predict`` meanwhile, which waits. Each replica comes with its API's secret:
        only a worker or admin key may ask (the route's scope)."""
        if version not in view.specs:  # as ``predict`` refuses it
            raise NotFound(f"version {version!r} is not served by deployment {view.name!r}")
        key = (view.tenant_id, view.name)
        if sent > 0:
            self.control.record_demand(key, version, view.cost(version).cost(1) * sent, True)
        now = time.monotonic()
        routes = [r for r in self.table.routes(key, version) if r.routable(now)]
        if not routes:
            self.control.wake(key, version)
        # A replica's whole queue bound (QUEUE_BATCHES batches), not the class's share of
        # it that the gateway admits: the replica computes online instances before any
        # batch ones, so a deep batch queue costs online traffic nothing, and it keeps the
        # model busy through the worker's pauses (its GIL, its next shard's parsing).
        window = QUEUE_BATCHES * view.policy.max_batch_size
        return {
            "model": view.model,
            "deployment": view.name,
            "version": version,
            "max_batch_size": view.policy.max_batch_size,
            "refresh_s": LANE_REFRESH_S,
            "replicas": [
                {"id": r.replica_id, "url": r.url, "secret": r.secret, "window": window}
                for r in routes
            ],
        }

    def candidates(
        self, view: DeploymentView, version: str, units: float, tried: set[str]
    ) -> list[Route]:
        """Ready replicas of ``version`` not tried yet with room for ``units`` in their
        bounded queue (QUEUE_BATCHES batches each); NotReady or BackPressure if none."""
        candidates = [
            r
            for r in self.table.routes((view.tenant_id, view.name), version)
            if r.replica_id not in tried
        ]
        if not candidates:
            raise NotReady(f"no ready replica of {view.name}:{version} left to try")
        cost = view.cost(version)
        per_replica = QUEUE_BATCHES * view.policy.max_batch_size * cost.cost(1)
        candidates = [r for r in candidates if r.inflight_units + units <= per_replica]
        if not candidates:
            self.control.metrics.request(view, version, "shed")
            batch_s = view.policy.max_queue_delay_ms / 1000 + cost.service_s(1)
            raise BackPressure(
                f"every replica of {view.name}:{version} has {QUEUE_BATCHES} batches queued",
                retry_after_s=max(1.0, QUEUE_BATCHES * batch_s),
                version=version,
            )
        return candidates

    def _replica_answered(
        self,
        route: Route,
        view: DeploymentView,
        version: str,
        window: LatencyWindow,
        elapsed: float,
        queue_ms: str | None,
    ) -> None:
        record_success(route)
        self.control.mark_ok(route.replica_id)
        window.add(elapsed)
        queue_s = None
        if queue_ms is not None:
            with contextlib.suppress(ValueError):
                queue_s = float(queue_ms) / 1000
        self.control.metrics.answered(view, version, elapsed, queue_s)

    async def _await_replica(
        self, key: tuple[int, str], version: str, units: float, deadline: float
    ) -> tuple[Sequence[Route], bool]:
        """No hot replica yet, but one is starting or can be promoted: wait for it within
        the deadline (reporting the demand, so a warm replica is promoted) instead of
        refusing a request that a replica would answer in a moment. A deployment with a
        degradation ladder degrades at once instead. Returns the routes and whether it
        reported the request's arrival."""
        if not self.control.wake(key, version):
            return (), False
        self.control.record_demand(key, version, units, admitted=False)
        while time.monotonic() < deadline and self.control.wake(key, version):
            await asyncio.sleep(WAIT_POLL_S)
            routes = self.table.routes(key, version)
            if routes:
                return routes, True
        return self.table.routes(key, version), True

    async def _send(
        self,
        route: Route,
        payload: dict[str, Any],
        headers: dict[str, str],
        units: float,
        remaining_s: float,
    ) -> HopAnswer:
        route.inflight_units += units
        try:
            timeout_s = max(0.001, remaining_s) + 1.0
            instances = payload["instances"]
            if isinstance(instances, TensorBody):  # the batch lane: its bytes, as they came
                timeout = {TIMEOUT_HEADER: f"{payload['timeout_ms']:.3f}"}
                return await self.hop.post(
                    route.url, "/infer", instances.data, headers | timeout, timeout_s,
                    content_type=instances.content_type, secret=route.secret,
                )  # fmt: skip
            # pydantic's encoder: ~6x json.dumps; NaN as NaN, as json.dumps writes it
            body = pydantic_core.to_json(payload, inf_nan_mode="constants")
            return await self.hop.post(
                route.url, "/infer", body, headers, timeout_s, secret=route.secret
            )
        finally:
            route.inflight_units -= units

    async def _hedged(
        self,
        route: Route,
        others: list[Route],
        payload: dict[str, Any],
        headers: dict[str, str],
        units: float,
        remaining_s: float,
        hedge_after: float,
        view: DeploymentView,
        version: str,
        tried: set[str],
    ) -> tuple[HopAnswer, Route, bool]:
        """Send to ``route``; if no answer after ``hedge_after`` s, a copy to another replica
        (within the retry budget); the first good answer wins and the other is cancelled."""
        first = asyncio.create_task(self._send(route, payload, headers, units, remaining_s))
        done, _ = await asyncio.wait({first}, timeout=hedge_after)
        if done or not others or not self.budget.try_withdraw(hedge=True):
            return await first, route, False
        second_route = pick_replica(others)
        tried.add(second_route.replica_id)
        self.control.metrics.hedged(view, version, "sent")
        rest = remaining_s - hedge_after
        second = asyncio.create_task(self._send(second_route, payload, headers, units, rest))
        owner = {first: route, second: second_route}
        pending: set[asyncio.Task[HopAnswer]] = {first, second}
        failure: BaseException | None = None
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    exc = task.exception()
                    if exc is None and task.result().status_code == 200:
                        if task is second:
                            self.control.metrics.hedged(view, version, "won")
                            # Outrun by a hedge: a strike against the slow replica, so a stuck
                            # one is ejected instead of costing a hedge per request.
                            record_failure(route)
                        return task.result(), owner[task], True
                    failure = failure or exc
                    if exc is None and not pending:
                        return task.result(), owner[task], True
            assert failure is not None
            raise failure
        finally:
            for task in pending:
                task.cancel()

    # --- the prediction log -----------------------------------------------------------------

    def _log(
        self,
        view: DeploymentView,
        tenant: str,
        chosen: str,
        instances: Instances,
        result: Prediction | None,
        started: float,
        input_digest: str | None,
        error: EmberError | None,
        params: dict[str, Any] | None,
        ended: float | None = None,
    ) -> None:
        input_value: Any = None
        payload_input: Any = instances
        if isinstance(instances, TensorBody):  # a digest of its bytes, never of lists
            input_digest = input_digest or _input_digest(instances, params)
            payload_input = instances.tolist() if view.policy.log_payloads else None
        else:
            input_value = {"i": instances, "p": params or {}}
        self.log_prediction(
            view,
            tenant,
            result.version if result else chosen,
            started,
            status=200 if result else _status(error),
            input_value=input_value,
            input_digest=input_digest,
            payload_input=payload_input,
            output_value=(result.content or result.body) if result else None,
            instances=len(instances),
            rung=result.rung if result else None,
            cache=result.cache if result else None,
            replica=result.replica_id if result else None,
            attempts=result.attempts if result else None,
            hedged=result.hedged if result else False,
            error=error.title if error else None,
            ended=ended,
        )

    def log_prediction(
        self,
        view: DeploymentView,
        tenant: str,
        version: str,
        started: float,
        *,
        status: int,
        input_value: Any,
        input_digest: str | None = None,
        payload_input: Any = None,
        output_value: Any = None,
        output_digest: str | None = None,
        instances: int | None = None,
        rung: str | None = None,
        cache: str | None = None,
        replica: str | None = None,
        attempts: int | None = None,
        hedged: bool = False,
        error: str | None = None,
        ended: float | None = None,
    ) -> None:
        """One prediction log record (every protocol route's answers go through here).

        Digests not given are computed by the log's writer thread, off the request's path:
        ``input_digest`` from ``input_value``, ``output_digest`` from ``output_value``.
        ``ended``: when the answer was ready (default: now)."""
        bound = structlog.contextvars.get_contextvars()
        record: dict[str, Any] = {
            "ts": time.time(),
            "request_id": bound.get("request_id"),
            "trace_id": bound.get("trace_id"),
            "tenant": tenant,
            "deployment": view.name,
            "model": view.model,
            "version": version,
            "artifact_sha256": spec.sha256 if (spec := view.specs.get(version)) else None,
            "rung": rung,
            "status": status,
            "latency_ms": round(((ended or time.monotonic()) - started) * 1000, 3),
            "cache": cache,
            "replica": replica,
            "attempts": attempts,
            "hedged": hedged,
            "instances": instances,
            "input_digest": input_digest,
            "output_digest": output_digest,
        }
        deferred: dict[str, Any] = {}
        if input_digest is None:
            deferred["input_digest"] = input_value
        if output_digest is None and output_value is not None:
            deferred["output_digest"] = output_value
        record[DEFERRED_DIGESTS] = deferred
        if error is not None:
            record["error"] = error
        if view.policy.log_payloads:
            record["input"] = input_value if payload_input is None else payload_input
            is_bytes = isinstance(output_value, bytes)
            record["output"] = json.loads(output_value) if is_bytes else output_value
        self.predictions.record(record)
        self.answers.record(view.tenant_id, view.name, version, status, rung, record["latency_ms"],
                            replica)  # fmt: skip

    async def close(self) -> None:
        await self.http.aclose()
        await self.hop.close()
        if self.cache is not None:
            await self.cache.close()
        await asyncio.to_thread(self.predictions.close)


def _input_digest(instances: Instances, params: dict[str, Any] | None) -> str:
    """The input's digest (response cache key, prediction log): of a tensor body's dtype,
    shape and bytes, else of the instances' canonical JSON."""
    if isinstance(instances, TensorBody):
        return instances.digest() if not params else digest({"t": instances.digest(), "p": params})
    return digest({"i": instances, "p": params or {}})


def _status(error: EmberError | None) -> int:
    if error is None:
        return 500
    upstream = getattr(error, "upstream_status", None)
    return int(upstream) if upstream else error.status


def _passthrough(response: HopAnswer) -> Upstream:
    try:
        body = json.loads(response.content)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {
            "type": "about:blank",
            "title": "Replica error",
            "status": response.status_code,
            "detail": response.content.decode("utf-8", "replace")[:500],
        }
    return Upstream(response.status_code, body, response.headers.get("retry-after"))


def _span_attributes(result: Prediction) -> dict[str, str]:
    """What the gateway span learns from the answer (the version may be a fallback's)."""
    return {"ember.version": result.version, "ember.replica": result.replica_id,
            "ember.rung": result.rung, "ember.cache": result.cache}  # fmt: skip


def _hop_timing(started: float, sent: float, answered: float, replica: str | None) -> str:
    """The model rung's ``Server-Timing`` parts (``Prediction.timing``), the replica's after."""
    ours = f"admit;dur={(sent - started) * 1000:.3f}, hop;dur={(answered - sent) * 1000:.3f}"
    return f"{ours}, {replica}" if replica else ours
