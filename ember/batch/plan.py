"""Planning a run (version pinned, input listed and cut into shards), publishing its
shards, and reading its progress.

Shard messages carry only a shard id; a worker claims the shard in the registry (a
fresh lease token, conditional UPDATE), so a duplicate message is harmless. At most
``max_parallel_shards`` of a run are published at once; each commit publishes the next.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from ember import tracing
from ember.batch import datasets
from ember.batch.schemas import BatchSpec, Progress, RunPublic, ShardError
from ember.config import Settings
from ember.errors import EmberError, InvalidInput, LoaderError
from ember.logs import bound, get_logger
from ember.registry import quotas
from ember.registry.tables import BatchRun, BatchSchedule, BatchShard
from ember.work.queue import QUEUE
from ember.work.versions import resolve

log = get_logger(__name__)
SHARD_TASK = "ember.batch.shard"
FINISHED = ("succeeded", "failed")


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_uid() -> str:
    return "br_" + secrets.token_hex(12)


def render(template: str, date: str) -> str:
    return template.replace("{date}", date)


def create_run(
    engine: Engine,
    settings: Settings,
    tenant_id: int,
    spec: BatchSpec,
    date: str,
    schedule: BatchSchedule | None = None,
    fire_at: datetime | None = None,
    strict: bool = True,
) -> tuple[BatchRun, bool]:
    """Plan and store a run; returns it and whether it is new (a scheduled fire time that
    already has a run returns that run). Raises problem errors for an unknown model or an
    unreadable input unless the run is scheduled (then the run is stored as failed)."""
    input_uri, output_uri = render(spec.input_uri, date), render(spec.output_uri, date)
    uid = new_uid()
    run = BatchRun(
        uid=uid,
        tenant_id=tenant_id,
        schedule_id=schedule.id if schedule else None,
        fire_key=f"{schedule.id}@{fire_at.isoformat()}" if schedule and fire_at else None,
        fire_at=fire_at,
        spec=spec.model_dump(mode="json"),
        model=spec.model.partition(":")[0][:63],
        deployment="",
        version="",
        input_uri=input_uri,
        output_uri=output_uri.rstrip("/") + "/" + uid,
        status="running",
    )
    shards: list[BatchShard] = []
    try:
        with Session(engine) as session:
            # Over the tenant's quota of runs in flight: 429, or a scheduled run recorded
            # as failed with the quota's refusal (beat goes on).
            quotas.check_batch_runs(
                session, quotas.limits_for(session, settings, tenant_id), tenant_id
            )
            _, deployment, pinned, row = resolve(session, tenant_id, spec.model)
        run.deployment = deployment.name
        run.version = pinned or row.version
        run.artifact_sha256 = row.sha256 or ""
        datasets.check_readable(settings, run.output_uri)
        shards = plan_shards(settings, spec, input_uri)
    except (EmberError, ValueError) as exc:
        if strict:
            raise
        run.status, run.error = "failed", _detail(exc)
        run.finished_at = utcnow()
    now = utcnow()
    run.started_at = now
    run.shards_total = len(shards)
    run.rows_total = sum(s.row_end - s.row_start for s in shards)
    if spec.deadline_s:
        run.deadline_at = now + timedelta(seconds=spec.deadline_s)
    with Session(engine, expire_on_commit=False) as session:
        session.add(run)
        try:
            session.flush()
        except IntegrityError:  # another beat fired this schedule time first
            session.rollback()
            existing = session.exec(select(BatchRun).where(BatchRun.fire_key == run.fire_key)).one()
            return existing, False
        for shard in shards:
            shard.run_id = run.id or 0
            session.add(shard)
        if run.rows_total == 0 and run.status == "running":
            run.status, run.finished_at = "succeeded", now
            session.add(run)
        session.commit()
    with bound(run_id=uid, model=run.model, version=run.version):
        log.info(
            "batch run planned",
            status=run.status,
            shards=run.shards_total,
            rows=run.rows_total,
            error=run.error,
        )
    return run, True


def _detail(exc: Exception) -> str:
    return (exc.detail if isinstance(exc, EmberError) else str(exc))[:2000]


def plan_shards(settings: Settings, spec: BatchSpec, input_uri: str) -> list[BatchShard]:
    try:
        files = datasets.list_inputs(settings, input_uri, settings.batch_max_files)
    except LoaderError as exc:
        raise InvalidInput(f"input_uri: {exc.detail}", input_uri=input_uri) from exc
    shards: list[BatchShard] = []
    for info in files:
        fmt = datasets.detect_format(info.uri, spec.format)
        try:
            data = datasets.read_object(settings, info)
            rows, lines = datasets.row_index(data, fmt, info.uri)  # lines: each shard's bytes
        except LoaderError as exc:
            raise InvalidInput(f"input_uri: {exc.detail}", input_uri=info.uri) from exc
        counted_to, lines_before = 0, 0  # physical lines before a shard's first byte
        for start in range(0, rows, spec.shard_rows):
            end = min(rows, start + spec.shard_rows)
            shard = BatchShard(
                run_id=0,
                number=len(shards),
                input_uri=info.uri,
                row_start=start,
                row_end=end,
                input_etag=info.etag if 0 < len(info.etag) <= 256 else None,
            )
            if lines is not None:
                shard.byte_start, shard.byte_end = int(lines[start, 0]), int(lines[end - 1, 1])
                lines_before += data.count(b"\n", counted_to, shard.byte_start)
                counted_to = shard.byte_start
                shard.line_start = lines_before + 1
            shards.append(shard)
        del data
    return shards


# --- publishing ------------------------------------------------------------------------


def pump(engine: Engine, celery: Any, run_id: int) -> int:
    """Publish queued shards of a running run until ``max_parallel_shards`` are in
    flight; returns how many were published."""
    published = 0
    with Session(engine) as session:
        run = session.get(BatchRun, run_id)
        if run is None or run.status != "running":
            return 0
        limit = int(run.spec.get("max_parallel_shards", 4))
        in_flight = session.exec(
            select(func.count()).where(
                BatchShard.run_id == run_id,
                col(BatchShard.status).in_(("queued", "running")),
                col(BatchShard.published_at).is_not(None),
            )
        ).one()
        waiting = session.exec(
            select(BatchShard.id)
            .where(
                BatchShard.run_id == run_id,
                BatchShard.status == "queued",
                col(BatchShard.published_at).is_(None),
            )
            .order_by(col(BatchShard.number))
            .limit(max(0, limit - in_flight))
        ).all()
    for shard_id in waiting:
        with Session(engine) as session:
            marked = session.execute(
                update(BatchShard)
                .where(col(BatchShard.id) == shard_id, col(BatchShard.published_at).is_(None))
                .values(published_at=utcnow())
            )
            session.commit()
        if getattr(marked, "rowcount", 0) == 1:
            publish(celery, shard_id or 0)
            published += 1
    return published


def publish(celery: Any, shard_id: int, countdown_s: float = 0.0) -> None:
    try:
        celery.send_task(
            SHARD_TASK,
            args=[shard_id],
            queue=QUEUE,
            priority=9,
            countdown=countdown_s if countdown_s > 0 else None,
            retry=False,
            headers=tracing.carrier(),  # the run's trace, which the shard continues
        )
    except Exception as exc:  # Redis down: the sweep publishes it again
        log.warning("batch shard not published", shard=shard_id, error=str(exc)[:300])


# --- views -----------------------------------------------------------------------------


def run_public(session: Session, run: BatchRun) -> RunPublic:
    shards = session.exec(select(BatchShard).where(BatchShard.run_id == run.id)).all()
    done = [s for s in shards if s.status == "committed"]
    scored = sum(s.rows_scored for s in done)
    rejected = sum(s.rows_rejected for s in done)
    rate: float | None = None
    eta: float | None = None
    if run.started_at is not None and scored:
        end = run.finished_at or utcnow()
        elapsed = (end - _aware(run.started_at)).total_seconds()
        if elapsed > 0:
            rate = round(scored / elapsed, 1)
            left = run.rows_total - scored - rejected
            eta = round(left / rate, 1) if run.status == "running" and rate else 0.0
    schedule = session.get(BatchSchedule, run.schedule_id) if run.schedule_id else None
    return RunPublic(
        id=run.uid,
        schedule=schedule.name if schedule else None,
        fire_at=run.fire_at,
        status=run.status,
        model=run.model,
        version=run.version,
        artifact_sha256=run.artifact_sha256,
        input_uri=run.input_uri,
        output_uri=run.output_uri,
        progress=Progress(
            shards_done=len(done),
            shards_total=run.shards_total,
            shards_failed=sum(1 for s in shards if s.status == "failed"),
            rows_total=run.rows_total,
            rows_scored=scored,
            rows_rejected=rejected,
            rows_per_s=rate,
            eta_s=eta,
        ),
        shard_errors=[
            ShardError(
                shard=s.number,
                input_uri=s.input_uri,
                rows=f"{s.row_start}-{s.row_end}",
                attempts=s.attempts,
                error=s.error or "",
            )
            for s in sorted(shards, key=lambda s: s.number)
            if s.error
        ],
        error=run.error,
        created_at=run.created_at,
        started_at=run.started_at,
        finished_at=run.finished_at,
        deadline_at=run.deadline_at,
    )


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)
