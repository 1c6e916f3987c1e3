"""Liveness and readiness (unauthenticated). ``/metrics`` is ``ember.api.metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

import ember

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
def healthz() -> dict[str, str]:
    return {"status": "ok", "version": ember.__version__}


@router.get("/readyz", summary="Readiness: the registry database answers")
def readyz(request: Request) -> JSONResponse:
    try:
        with request.app.state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        body = {"status": "unavailable", "detail": f"registry: {type(exc).__name__}"}
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ready"})
