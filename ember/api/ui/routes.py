"""The dashboard: its pages under ``/ui`` (static files shipped with the package, a strict
Content-Security-Policy, no key needed to fetch them: they hold no data), and the few
read-only JSON endpoints it needs that the API did not have, each behind the same key
checks as the rest of the control plane and scoped to the calling key's tenant."""

from __future__ import annotations

import mimetypes
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import func
from sqlalchemy import select as sa_select
from sqlmodel import col, select

from ember.api.deps import PrincipalDep, SessionDep
from ember.batch import plan
from ember.batch.schemas import RunPublic, SchedulePublic
from ember.errors import NotFound, NotReady
from ember.jobs.schemas import JobSummary, job_summary
from ember.pools.history import History
from ember.registry import deployments
from ember.registry.schemas import NAME_PATTERN
from ember.registry.tables import BatchRun, BatchSchedule, Job, JobStatus

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
"""Everything from the API's own origin, nothing inline, no frames."""

HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}

RECENT = 50
"""Recent jobs and batch runs the dashboard lists."""


def _static_files() -> dict[str, tuple[bytes, str]]:
    """Every file under ``ember/api/ui/static`` (read once): path -> (bytes, media type). Only
    these are served: no path from a request ever reaches the file system."""
    files: dict[str, tuple[bytes, str]] = {}

    def walk(node: Any, prefix: str) -> None:
        for child in node.iterdir():
            name = f"{prefix}{child.name}"
            if child.is_dir():
                walk(child, f"{name}/")
            elif child.is_file():
                media = mimetypes.guess_type(child.name)[0] or "application/octet-stream"
                if media.startswith("text/") or media == "application/javascript":
                    media += "; charset=utf-8"
                files[name] = (child.read_bytes(), media)

    walk(resources.files("ember.api.ui") / "static", "")
    return files


_FILES: dict[str, tuple[bytes, str]] | None = None


def static_file(path: str) -> tuple[bytes, str]:
    global _FILES
    if _FILES is None:
        _FILES = _static_files()
    found = _FILES.get(path)
    if found is None:
        raise NotFound("no such dashboard file")
    return found


pages = APIRouter(include_in_schema=False)


@pages.get("/ui")
def index() -> Response:
    body, media = static_file("index.html")
    return Response(body, media_type=media, headers=HEADERS)


@pages.get("/ui/")
def index_slash() -> Response:
    return RedirectResponse("/ui", status_code=308, headers=HEADERS)


@pages.get("/ui/static/{path:path}")
def asset(path: Annotated[str, Path(max_length=200)]) -> Response:
    body, media = static_file(path)
    return Response(body, media_type=media, headers=HEADERS)


# --- JSON the pages read (control plane: mounted with the ControlPlane dependency) ---------

router = APIRouter(tags=["dashboard"])
DeploymentName = Annotated[str, Path(pattern=NAME_PATTERN, description="Deployment name.")]


def history_of(request: Request) -> History:
    """The pools controller's history; on an API process that runs none, a reader of the
    one in Redis (the leader's samples)."""
    pools = getattr(request.app.state, "pools", None)
    history: History | None = pools.history if pools is not None else None
    if history is None:
        history = getattr(request.app.state, "history", None)
    if history is None:
        url = request.app.state.settings.redis_url
        if not url:
            raise NotReady(
                "this API process runs no pools controller and has no EMBER_REDIS_URL: "
                "no deployment history to show"
            )
        history = request.app.state.history = History(url)
    return history


@router.get("/v1/deployments/{name}/history", summary="Replicas by tier and demand over time")
def deployment_history(
    name: DeploymentName,
    request: Request,
    principal: PrincipalDep,
    session: SessionDep,
    since: Annotated[
        float | None,
        Query(ge=0, le=1e11, description="Only samples after this time (Unix seconds)."),
    ] = None,
) -> dict[str, Any]:
    """Samples taken by the acting pools controller every `every_s` seconds over the last
    `keep_s`, oldest first: replicas per tier (`standby`: the shared standby pool),
    arrived and admitted model units/s (the mean over the autoscaler's steps since the
    previous sample) and the forecast at each tier's horizon."""
    deployment = deployments.get(session, principal.tenant_id, name)
    history = history_of(request)
    samples = history.series((deployment.tenant_id, deployment.name), since)
    return {
        "deployment": name,
        "every_s": history.every_s,
        "keep_s": history.keep_s,
        "samples": samples,
    }


@router.get("/v1/deployments/{name}/answers", summary="Recent latency, errors and rungs")
def deployment_answers(
    name: DeploymentName,
    request: Request,
    principal: PrincipalDep,
    session: SessionDep,
    window_s: Annotated[float, Query(gt=0, le=3600, description="Seconds to look back.")] = 300,
) -> dict[str, Any]:
    """Per version, the answers this API process sent over the last `window_s`: their
    count, latency p50 / p99 (ms, of those answered), the share that failed (5xx) or
    were shed (429), and the ladder rung that served them; and when each replica sent its
    first answer (`first_answers`: replica id -> Unix time)."""
    deployment = deployments.get(session, principal.tenant_id, name)
    gateway = getattr(request.app.state, "gateway", None)
    if gateway is None:
        raise NotReady("this API process runs no pools controller (EMBER_POOLS_ENABLED=false)")
    key = (deployment.tenant_id, deployment.name)
    versions = gateway.answers.summary(*key, window_s)
    first = dict(gateway.answers.first_answers.get(key, {}))
    return {"deployment": name, "window_s": window_s, "versions": versions, "first_answers": first}


@router.get("/v1/dashboard/jobs", summary="Job queue depth and recent jobs")
def dashboard_jobs(principal: PrincipalDep, session: SessionDep) -> dict[str, Any]:
    """Unfinished jobs per deployment, priority and state (count and model units), and
    the most recent jobs, newest first."""
    unfinished = (JobStatus.queued, JobStatus.running)
    rows = session.execute(
        sa_select(
            col(Job.deployment),
            col(Job.priority),
            col(Job.status),
            func.count(),
            func.sum(Job.units),
        )
        .where(col(Job.tenant_id) == principal.tenant_id, col(Job.status).in_(unfinished))
        .group_by(col(Job.deployment), col(Job.priority), col(Job.status))
    ).all()
    queue = [
        {"deployment": d, "priority": p, "status": s, "jobs": n, "units": float(u or 0.0)}
        for d, p, s, n, u in sorted(rows, key=lambda r: (r[0], -r[1], r[2]))
    ]
    recent_rows = session.exec(
        select(Job)
        .where(Job.tenant_id == principal.tenant_id)
        .order_by(col(Job.id).desc())
        .limit(RECENT)
    ).all()
    recent: list[JobSummary] = [job_summary(j) for j in recent_rows]
    return {"queue": queue, "recent": [j.model_dump(mode="json") for j in recent]}


@router.get("/v1/dashboard/batch", summary="Batch schedules and recent runs")
def dashboard_batch(principal: PrincipalDep, session: SessionDep) -> dict[str, Any]:
    """Every schedule with its next fire time, and the most recent runs (newest first)
    with their progress."""
    from ember.api.routes.batch import schedule_public

    schedules: list[SchedulePublic] = [
        schedule_public(s)
        for s in session.exec(
            select(BatchSchedule)
            .where(BatchSchedule.tenant_id == principal.tenant_id)
            .order_by(col(BatchSchedule.name))
        )
    ]
    runs: list[RunPublic] = [
        plan.run_public(session, r)
        for r in session.exec(
            select(BatchRun)
            .where(BatchRun.tenant_id == principal.tenant_id)
            .order_by(col(BatchRun.id).desc())
            .limit(RECENT)
        )
    ]
    return {
        "schedules": [s.model_dump(mode="json") for s in schedules],
        "runs": [r.model_dump(mode="json") for r in runs],
    }
