"""The FastAPI application factory. No settings, engines or side effects at import time."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from sqlalchemy import Engine

import ember
from ember import tracing
from ember.api import metrics as metrics_routes
from ember.api.deps import ControlPlane, PrincipalCache
from ember.api.routes import batch as batch_routes
from ember.api.routes import deployments, health, jobs, models, openai, predict, tenants, v2
from ember.api.ui import routes as ui_routes
from ember.config import Settings
from ember.jobs import demand as jobs_demand
from ember.logs import get_logger
from ember.registry.db import make_engine, migrate, session_scope
from ember.registry.tenants import bootstrap
from ember.registry.validation import BackgroundValidator
from ember.web import problems
from ember.web.lane import JSON_MEDIA, LaneApp
from ember.web.middleware import TENSOR_MEDIA, BodyLimit, JsonBodies, RequestContext

if TYPE_CHECKING:
    from ember.pools.controller import PoolsController
    from ember.serving.gateway import Gateway

log = get_logger(__name__)


def prepare(settings: Settings, engine: Engine | None = None) -> tuple[Engine, str | None]:
    """Create the data directory, migrate the registry and bootstrap the admin key.

    Idempotent. Returns the engine and the admin key if one was generated just now.
    """
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = engine or make_engine(settings.registry_url)
    migrate(engine)
    admin = settings.admin_key.get_secret_value() if settings.admin_key else None
    with session_scope(engine) as session:
        generated = bootstrap(session, admin)
    return engine, generated


def create_app(
    settings: Settings, engine: Engine | None = None, *, freeze_gc: bool = False
) -> FastAPI:
    """The API. ``freeze_gc`` (the ``ember serve``/``ember up`` process, which runs nothing
    else): once started, move everything made so far out of the cyclic GC's view, as the
    worker and the replicas do: a full collection then walks only what was made since,
    instead of stalling the event loop over start-up's objects too."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        traced = tracing.setup(settings, "ember-api")  # OTLP export: EMBER_OTEL_ENDPOINT
        app.state.engine, _ = prepare(settings, engine)
        app.state.validator = BackgroundValidator(app.state.engine, settings)
        resumed = app.state.validator.resume_pending()
        if settings.pools_enabled:
            app.state.pools, app.state.gateway = start_pools(settings, app.state.engine)
        jobs_demand.attach(app, settings)  # job publisher; queue depth to the autoscaler
        log.info("ember api ready", registry=settings.registry_url.split("@")[-1],
                 resumed_validations=resumed)  # fmt: skip
        loopback_metrics = None
        if settings.metrics_port is not None:  # /metrics on loopback only, no key
            loopback_metrics = metrics_routes.LoopbackMetrics(app, settings.metrics_port)
            await loopback_metrics.start()
        if freeze_gc:
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            if loopback_metrics is not None:
                await loopback_metrics.close()
            app.state.validator.close()
            jobs_demand.detach(app)
            if getattr(app.state, "ratelimiter", None) is not None:
                await app.state.ratelimiter.close()
            if getattr(app.state, "gateway", None) is not None:
                await app.state.gateway.close()
                pools = app.state.pools
                await pools.stop()
                pools.metrics.close()  # the last cost counts
                if pools.history is not None:
                    pools.history.close()
            if getattr(app.state, "history", None) is not None:  # the dashboard's reader
                app.state.history.close()
            if traced:
                tracing.shutdown()

    app = LaneApp(
        title="Ember",
        version=ember.__version__,
        summary="Serverless-style model platform: register, deploy and call model versions.",
        lifespan=lifespan,
        responses=problems.PROBLEM_RESPONSES,
    )
    app.state.settings = settings
    app.state.principals = PrincipalCache()
    problems.install(app)
    # The data plane first: its routes are matched on every request.
    for module in (predict, v2, openai, health):
        app.include_router(module.router)
    # The control plane: no worker keys, and each tenant key held to its request rate.
    for module in (tenants, models, deployments, jobs, batch_routes):
        app.include_router(module.router, dependencies=[ControlPlane])
    app.include_router(metrics_routes.costs, dependencies=[ControlPlane])  # cost per success
    app.include_router(ui_routes.router, dependencies=[ControlPlane])  # the dashboard's JSON
    app.include_router(ui_routes.pages)  # the dashboard: /ui (static, no data)
    if settings.metrics_port is None:  # else on loopback only (``ember.api.metrics``)
        app.include_router(metrics_routes.router)
    # In front of everything: the predict lane takes what it reads (``ember.web.lane``).
    app.add_lane(
        predict.PREDICT_PATH,
        predict.lean_predict,
        max_bytes=settings.max_request_bytes,
        media=(*JSON_MEDIA, TENSOR_MEDIA),
        timing=b"api",  # Server-Timing's first part: the API process's whole time
    )
    app.add_middleware(JsonBodies)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(RequestContext)
    return app


def start_pools(settings: Settings, engine: Engine) -> tuple[PoolsController, Gateway]:
    """The pools controller (local processes or Kubernetes pods) — the control side — and
    the gateway in front — the serving side, which sees the controller only through the
    ``ControlPlane`` interface. Every collaborator of the controller is given at
    construction; nothing is attached to it afterwards."""
    from ember.pools.actions import ProbeSettings
    from ember.pools.backends import create_backend, standby_pool
    from ember.pools.controller import PoolsController
    from ember.pools.costs import CostLedger
    from ember.pools.demand import ForecastStore, SharedDemand
    from ember.pools.history import History
    from ember.pools.leader import election_for
    from ember.pools.scaling import autoscale_knobs
    from ember.pools.warmtier import SharedWarmTier
    from ember.serving.admission import Admission
    from ember.serving.cache import ResponseCache
    from ember.serving.gateway import Gateway
    from ember.serving.predlog import PredictionLog

    probe = ProbeSettings(settings.probe_idle_s, settings.probe_timeout_s, settings.probe_failures)
    backend = create_backend(settings)  # local processes, or Kubernetes with a Lease
    standby_floor, standby_max = standby_pool(settings)
    leader = election_for(settings, backend)
    redis_url = settings.redis_url
    controller = PoolsController(
        engine,
        backend,
        standby_pool=standby_floor,
        standby_max=standby_max,
        probe=probe,
        leader=leader,
        autoscale=autoscale_knobs(settings),
        fill_warm=settings.scale_fill_warm,
        standby_reserve_max=settings.standby_reserve_max_bytes,
        # the job queue's backlog, so that it scales the pool to drain it
        async_demand=jobs_demand.QueuedDemand(engine),
        # several API processes: the followers' gateways' demand, summed for the leader
        shared_demand=SharedDemand(redis_url) if leader is not None and redis_url else None,
        # the autoscalers' learned state survives restarts and leaders
        forecast_store=ForecastStore(redis_url) if redis_url else None,
        # local processes share this host's RAM
        warm_tier=(
            None if backend.replicas_outlive_controller else SharedWarmTier.from_settings(settings)
        ),
        history=History(redis_url),  # the dashboard's time series
    )
    controller.metrics.use_costs(CostLedger(redis_url))  # shared through Redis
    controller.start()
    admission = Admission(settings.tenant_units_per_s, settings.tenant_burst_units)
    cache = ResponseCache(
        redis_url,
        front_entries=settings.response_cache_entries,
        max_bytes=settings.response_cache_max_bytes,
    )
    gateway = Gateway(
        controller,
        admission,
        settings.retry_budget_ratio,
        cache=cache,
        predictions=PredictionLog.from_settings(settings),
        ladder_reserve=settings.ladder_reserve,
    )
    return controller, gateway
