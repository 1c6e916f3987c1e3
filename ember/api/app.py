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
from ember.api import problems
from ember.api.deps import ControlPlane, PrincipalCache
from ember.api.lane import JSON_MEDIA, LaneApp
from ember.api.middleware import TENSOR_MEDIA, BodyLimit, JsonBodies, RequestContext
from ember.api.routes import batch as batch_routes
from ember.api.routes import deployments, health, jobs, models, openai, predict, tenants, v2
from ember.config import Settings
from ember.jobs import demand as jobs_demand
from ember.logs import get_logger
from ember.registry.db import make_engine, migrate, session_scope
from ember.registry.tenants import bootstrap
from ember.registry.validation import BackgroundValidator
from ember.ui import routes as ui_routes

if TYPE_CHECKING:
    from ember.pools.gateway import Gateway

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
            app.state.gateway = start_pools(settings, app.state.engine)
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
                await app.state.gateway.controller.stop()
                app.state.gateway.controller.metrics.close()  # the last cost counts
                if app.state.gateway.controller.history is not None:
                    app.state.gateway.controller.history.close()
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
    # In front of everything: the predict lane takes what it reads (``ember.api.lane``).
    app.add_lane(
        predict.PREDICT_PATH,
        predict.lean_predict,
        max_bytes=settings.max_request_bytes,
        media=(*JSON_MEDIA, TENSOR_MEDIA),
    )
    app.add_middleware(JsonBodies)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(RequestContext)
    return app


def start_pools(settings: Settings, engine: Engine) -> Gateway:
    """The pools controller (local processes or Kubernetes pods) and the gateway in front."""
    from ember.pools.admission import Admission
    from ember.pools.backends import create_backend, standby_pool
    from ember.pools.cache import ResponseCache
    from ember.pools.controller import PoolsController, ProbeSettings, autoscale_knobs
    from ember.pools.gateway import Gateway
    from ember.pools.leader import election_for
    from ember.pools.predlog import PredictionLog

    probe = ProbeSettings(settings.probe_idle_s, settings.probe_timeout_s, settings.probe_failures)
    backend = create_backend(settings)  # local processes, or Kubernetes with a Lease
    standby_floor, standby_max = standby_pool(settings)
    controller = PoolsController(
        engine,
        backend,
        standby_pool=standby_floor,
        standby_max=standby_max,
        probe=probe,
        leader=election_for(settings, backend),
        autoscale=autoscale_knobs(settings),
        fill_warm=settings.scale_fill_warm,
        standby_reserve_max=settings.standby_reserve_max_bytes,
    )
    if not backend.replicas_outlive_controller:  # local processes share this host's RAM
        from ember.pools.warmtier import SharedWarmTier

        controller.warm_tier = SharedWarmTier.from_settings(settings)
        if controller.warm_tier is not None:
            controller.warm_tier.register_metrics(controller.metrics.registry)
    if controller.leader is not None and settings.redis_url:
        from ember.pools.demand import SharedDemand

        controller.shared_demand = SharedDemand(settings.redis_url)
    if settings.redis_url:  # the autoscalers' learned state survives restarts and leaders
        from ember.pools.demand import ForecastStore

        controller.forecast_store = ForecastStore(settings.redis_url)
    from ember.pools.history import History

    controller.history = History(settings.redis_url)  # the dashboard's time series
    from ember.pools.costs import CostLedger

    controller.metrics.use_costs(CostLedger(settings.redis_url))  # shared through Redis
    controller.start()
    admission = Admission(settings.tenant_units_per_s, settings.tenant_burst_units)
    cache = ResponseCache(
        settings.redis_url,
        front_entries=settings.response_cache_entries,
        max_bytes=settings.response_cache_max_bytes,
    )
    return Gateway(
        controller,
        admission,
        settings.retry_budget_ratio,
        cache=cache,
        predictions=PredictionLog.from_settings(settings),
        ladder_reserve=settings.ladder_reserve,
    )
