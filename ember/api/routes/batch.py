"""The batch regime: cron schedules that score datasets, and their runs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response, status
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from ember.api.deps import Cursor, Limit, PrincipalDep, SessionDep, SettingsDep
from ember.api.routes.jobs import _publisher
from ember.batch import plan
from ember.batch.schemas import (
    RUN_ID_PATTERN,
    BatchSpec,
    RunCreate,
    RunPublic,
    ScheduleCreate,
    SchedulePublic,
    next_fire,
)
from ember.config import Settings
from ember.errors import Conflict, InvalidInput, NotFound
from ember.registry.pagination import paginate
from ember.registry.schemas import NAME_PATTERN, Page
from ember.registry.tables import BatchRun, BatchSchedule
from ember.registry.tenants import Principal
from ember.web.problems import problem_responses
from ember.work.versions import resolve

router = APIRouter(tags=["batch"])
ScheduleName = Annotated[str, Path(pattern=NAME_PATTERN, max_length=63)]
RunId = Annotated[str, Path(pattern=RUN_ID_PATTERN, description="A run id (`br_...`).")]


def check_spec(session: Session, settings: Settings, principal: Principal, spec: BatchSpec) -> None:
    """The model resolves, and the URIs are the tenant's (admins: anywhere the object
    store allows)."""
    resolve(session, principal.tenant_id, spec.model)
    from ember.batch import datasets

    datasets.check_spec_uris(
        settings,
        None if principal.is_admin else principal.tenant,
        plan.render(spec.input_uri, "2000-01-01"),
        plan.render(spec.output_uri, "2000-01-01"),
    )


def schedule_public(row: BatchSchedule) -> SchedulePublic:
    return SchedulePublic(
        name=row.name,
        cron=row.cron,
        timezone=row.timezone,
        catch_up=row.catch_up,
        paused=row.paused,
        spec=row.spec,
        next_fire_at=row.next_fire_at,
        last_fired_at=row.last_fired_at,
        created_at=row.created_at,
    )


def _schedule(session: Session, tenant_id: int, name: str) -> BatchSchedule:
    row = session.exec(
        select(BatchSchedule).where(
            BatchSchedule.tenant_id == tenant_id, BatchSchedule.name == name
        )
    ).first()
    if row is None:
        raise NotFound(f"batch schedule {name!r} does not exist")
    return row


@router.post(
    "/v1/batch/schedules", status_code=status.HTTP_201_CREATED, summary="Create a schedule"
)
def create_schedule(
    body: ScheduleCreate,
    response: Response,
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
) -> SchedulePublic:
    """Fires at each `cron` time in `timezone` (`ember beat`); each firing is a run."""
    check_spec(session, settings, principal, body)
    spec = BatchSpec.model_validate(body.model_dump(include=set(BatchSpec.model_fields)))
    now = datetime.now(UTC)
    row = BatchSchedule(
        tenant_id=principal.tenant_id,
        name=body.name,
        cron=body.cron,
        timezone=body.timezone,
        catch_up=body.catch_up,
        paused=body.paused,
        spec=spec.model_dump(mode="json"),
        next_fire_at=next_fire(body.cron, body.timezone, now),
    )
    session.add(row)
    try:
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise Conflict(f"batch schedule {body.name!r} already exists") from exc
    response.headers["Location"] = f"/v1/batch/schedules/{row.name}"
    return schedule_public(row)


@router.get("/v1/batch/schedules", summary="List schedules")
def list_schedules(
    principal: PrincipalDep, session: SessionDep, limit: Limit = 50, cursor: Cursor = None
) -> Page[SchedulePublic]:
    query = select(BatchSchedule).where(BatchSchedule.tenant_id == principal.tenant_id)
    rows, next_cursor = paginate(session, query, BatchSchedule.id, limit, cursor)
    return Page(items=[schedule_public(r) for r in rows], next_cursor=next_cursor)


@router.get("/v1/batch/schedules/{name}", summary="Get a schedule")
def get_schedule(
    name: ScheduleName, principal: PrincipalDep, session: SessionDep
) -> SchedulePublic:
    return schedule_public(_schedule(session, principal.tenant_id, name))


def _set_paused(session: Session, tenant_id: int, name: str, paused: bool) -> SchedulePublic:
    row = _schedule(session, tenant_id, name)
    row.paused = paused
    if not paused:  # fire times that passed while paused are not missed runs
        row.next_fire_at = next_fire(row.cron, row.timezone, datetime.now(UTC))
    row.updated_at = datetime.now(UTC)
    session.add(row)
    session.commit()
    return schedule_public(row)


@router.post("/v1/batch/schedules/{name}/pause", summary="Pause a schedule")
def pause_schedule(
    name: ScheduleName, principal: PrincipalDep, session: SessionDep
) -> SchedulePublic:
    return _set_paused(session, principal.tenant_id, name, True)


@router.post("/v1/batch/schedules/{name}/resume", summary="Resume a schedule")
def resume_schedule(
    name: ScheduleName, principal: PrincipalDep, session: SessionDep
) -> SchedulePublic:
    return _set_paused(session, principal.tenant_id, name, False)


@router.delete(
    "/v1/batch/schedules/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete a schedule (its runs are kept)",
)
def delete_schedule(name: ScheduleName, principal: PrincipalDep, session: SessionDep) -> None:
    row = _schedule(session, principal.tenant_id, name)
    session.execute(
        update(BatchRun).where(col(BatchRun.schedule_id) == row.id).values(schedule_id=None)
    )
    session.delete(row)
    session.commit()


@router.post(
    "/v1/batch/runs",
    status_code=status.HTTP_202_ACCEPTED,
    summary="Start a run",
    responses=problem_responses((429, "Over the tenant's quota of batch runs in flight")),
)
def start_run(
    body: RunCreate,
    request: Request,
    response: Response,
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
) -> RunPublic:
    """Run a schedule now (`schedule`), or an ad-hoc `spec`. The version is resolved now
    and pinned; the input is listed and cut into shards now (an unreadable input is a
    422 here, not a failed run later)."""
    if (body.schedule is None) == (body.spec is None):
        raise InvalidInput("give exactly one of `schedule` (a schedule's name) or `spec`")
    schedule = None
    if body.spec is not None:
        spec = body.spec
    else:
        schedule = _schedule(session, principal.tenant_id, body.schedule or "")
        spec = BatchSpec.model_validate(schedule.spec)
    check_spec(session, settings, principal, spec)
    date = body.date or datetime.now(UTC).date().isoformat()
    engine = request.app.state.engine
    run, _ = plan.create_run(engine, settings, principal.tenant_id, spec, date, schedule)
    plan.pump(engine, _publisher(request).celery, run.id or 0)
    response.headers["Location"] = f"/v1/batch/runs/{run.uid}"
    session.expire_all()
    return plan.run_public(session, _run(session, principal.tenant_id, run.uid))


def _run(session: Session, tenant_id: int, uid: str) -> BatchRun:
    row = session.exec(
        select(BatchRun).where(BatchRun.uid == uid, BatchRun.tenant_id == tenant_id)
    ).first()
    if row is None:
        raise NotFound(f"batch run {uid!r} does not exist")
    return row


@router.get("/v1/batch/runs", summary="List runs")
def list_runs(
    principal: PrincipalDep,
    session: SessionDep,
    schedule: Annotated[str | None, Query(pattern=NAME_PATTERN, max_length=63)] = None,
    limit: Limit = 50,
    cursor: Cursor = None,
) -> Page[RunPublic]:
    query = select(BatchRun).where(BatchRun.tenant_id == principal.tenant_id)
    if schedule is not None:
        query = query.where(
            BatchRun.schedule_id == _schedule(session, principal.tenant_id, schedule).id
        )
    rows, next_cursor = paginate(session, query, BatchRun.id, limit, cursor)
    return Page(items=[plan.run_public(session, r) for r in rows], next_cursor=next_cursor)


@router.get("/v1/batch/runs/{run_id}", summary="Get a run with its progress")
def get_run(run_id: RunId, principal: PrincipalDep, session: SessionDep) -> RunPublic:
    return plan.run_public(session, _run(session, principal.tenant_id, run_id))
