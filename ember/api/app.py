"""The FastAPI application factory. No settings, engines or side effects at import time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy import Engine

import ember
from ember.api import problems
from ember.api.middleware import BodyLimit, JsonBodies, RequestContext
from ember.api.routes import deployments, health, models, tenants
from ember.config import Settings
from ember.logs import get_logger
from ember.registry.db import make_engine, migrate, session_scope
from ember.registry.tenants import bootstrap
from ember.registry.validation import BackgroundValidator

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


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine, _ = prepare(settings, engine)
        app.state.validator = BackgroundValidator(app.state.engine, settings)
        resumed = app.state.validator.resume_pending()
        log.info("ember api ready", registry=settings.registry_url.split("@")[-1],
                 resumed_validations=resumed)  # fmt: skip
        try:
            yield
        finally:
            app.state.validator.close()

    app = FastAPI(
        title="Ember",
        version=ember.__version__,
        summary="Serverless-style model platform: register, deploy and call model versions.",
        lifespan=lifespan,
        responses=problems.PROBLEM_RESPONSES,
    )
    app.state.settings = settings
    problems.install(app)
    for module in (health, tenants, models, deployments):
        app.include_router(module.router)
    app.add_middleware(JsonBodies)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(RequestContext)
    return app
