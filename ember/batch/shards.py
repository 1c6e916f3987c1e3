"""What a worker does with one shard message, and the sweep that recovers lost shards.

1. **Claim**: ``queued`` → ``running`` with a fresh lease token, or take over a
   ``running`` shard whose lease expired (its worker died). A committed shard, a failed
   one or a finished run claims nothing: the message is acknowledged and dropped.
2. **Score** the shard's rows through the gateway (``POST /v1/models/{m}/versions/{v}
   :predict``, ``"priority": "batch"``, admin key + ``X-Ember-Tenant``) in batches of the
   deployment's ``max_batch_size``, always on the run's pinned version. Rows that cannot
   be scored (unparseable, a missing column, the wrong shape) go to the rejects file.
   The lease is renewed in the background; a lost lease stops the attempt.
3. **Write** ``part-NNNNN.parquet`` (one object per shard, written whole and renamed
   into place, so a retry overwrites it with the same rows and no row is ever written
   twice) and ``rejects/part-NNNNN.jsonl``, then **commit** fenced on the lease.
4. The last commit writes ``_manifest.json`` and marks the run succeeded; every commit
   publishes the run's next queued shard.
"""

from __future__ import annotations

import json
import random
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import Engine, and_, or_, update
from sqlmodel import Session, col, select

from ember.batch import datasets
from ember.batch.plan import FINISHED, SHARD_TASK, publish, pump, utcnow
from ember.batch.schemas import BatchSpec
from ember.config import Settings
from ember.errors import EmberError, InvalidInput, LoaderError, StoreUnavailable
from ember.jobs import results
from ember.jobs.runner import api_url, worker_id
from ember.loader.stores import ObjectInfo
from ember.logs import get_logger, model_context
from ember.registry.schemas import PoolPolicy
from ember.registry.tables import BatchRun, BatchShard, Deployment, Model, ModelVersion, Tenant

log = get_logger(__name__)
PERMANENT = {400, 404, 405, 409, 410, 413, 415, 422}
WAIT_FOR_CAPACITY_S = 300.0
"""How long one batch call waits out 429 (shed for online traffic) and 503 (no ready
replica) before the attempt is retried later."""


class Retry(Exception):
    """A transient failure: the shard is released and tried again."""


class Fatal(Exception):
    """The shard cannot succeed (too many rejects, the version is gone)."""


class Lost(Exception):
    """The lease was lost: another worker owns the shard now."""


@dataclass
class Lease:
    engine: Engine
    shard_id: int
    token: str
    lease_s: float
    lost: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def keep(self) -> None:
        threading.Thread(target=self._renew, daemon=True, name="ember-batch-lease").start()

    def _renew(self) -> None:
        while not self.done.wait(self.lease_s / 3):
            try:
                with Session(self.engine) as session:
                    result = session.execute(
                        update(BatchShard)
                        .where(
                            col(BatchShard.id) == self.shard_id,
                            col(BatchShard.lease) == self.token,
                            col(BatchShard.status) == "running",
                        )
                        .values(lease_expires_at=utcnow() + timedelta(seconds=self.lease_s))
                    )
                    session.commit()
                if getattr(result, "rowcount", 0) != 1:
                    self.lost.set()
                    return
            except Exception as exc:  # the registry is down: keep trying
                log.warning("batch lease renewal failed", shard=self.shard_id, error=str(exc))


class ShardRunner:
    def __init__(self, settings: Settings, engine: Engine, celery: Any) -> None:
        self.settings = settings
        self.engine = engine
        self.celery = celery
        key = settings.jobs_api_key.get_secret_value() if settings.jobs_api_key else ""
        self.http = httpx.Client(
            base_url=api_url(settings),
            headers={"Authorization": f"Bearer {key}"},
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
        )
        self.worker = worker_id()
        self.lock = threading.Lock()
        self.gates: dict[tuple[str, str], threading.Semaphore] = {}

    # --- one message -------------------------------------------------------------------

    def run(self, shard_id: int) -> str:
        lease = self.claim(shard_id)
        if lease is None:
            return "skipped"
        with Session(self.engine, expire_on_commit=False) as session:
            shard = session.get(BatchShard, shard_id)
            run = session.get(BatchRun, shard.run_id) if shard else None
        if shard is None or run is None:
            return "skipped"
        lease.keep()
        try:
            with model_context(run.model, run.version, run_id=run.uid, shard=shard.number):
                return self._attempt(run, shard, lease)
        finally:
            lease.done.set()
            pump(self.engine, self.celery, run.id or 0)

    def claim(self, shard_id: int) -> Lease | None:
        s = self.settings
        token = secrets.token_hex(16)
        now = utcnow()
        with Session(self.engine) as session:
            shard = session.get(BatchShard, shard_id)
            if shard is None:
                return None
            run = session.get(BatchRun, shard.run_id)
            if run is None or run.status in FINISHED:
                return None
            result = session.execute(
                update(BatchShard)
                .where(
                    col(BatchShard.id) == shard_id,
                    or_(
                        col(BatchShard.status) == "queued",
                        and_(
                            col(BatchShard.status) == "running",
                            col(BatchShard.lease_expires_at) < now,
                        ),
                    ),
                )
                .values(
                    status="running",
                    lease=token,
                    lease_expires_at=now + timedelta(seconds=s.batch_lease_s),
                    attempts=BatchShard.attempts + 1,
                    updated_at=now,
                )
            )
            session.commit()
        if getattr(result, "rowcount", 0) != 1:
            return None
        return Lease(self.engine, shard_id, token, s.batch_lease_s)

    def _attempt(self, run: BatchRun, shard: BatchShard, lease: Lease) -> str:
        try:
            if run.deadline_at is not None and _aware(run.deadline_at) < utcnow():
                self._fail_run(run, "the run passed its deadline")
                raise Fatal("the run passed its deadline")
            scored, rejects = self._score(run, shard, lease)
            return self._commit(run, shard, lease, scored, rejects)
        except Lost:
            log.info("batch shard attempt stopped: lease lost (taken over)")
            return "lost"
        except Fatal as exc:
            self._settle(shard, lease, "failed", str(exc))
            self._fail_run(run, f"shard {shard.number} failed: {exc}")
            log.warning("batch shard failed", error=str(exc))
            return "failed"
        except Exception as exc:  # Retry, an outage or a bug: try again, never lose rows
            error = f"{type(exc).__name__}: {exc}"[:1000]
            if shard.attempts >= self.settings.batch_max_attempts:
                gave_up = f"gave up after {shard.attempts} attempts: {error}"
                self._settle(shard, lease, "failed", gave_up)
                self._fail_run(run, f"shard {shard.number} failed: {error}")
                return "failed"
            self._settle(shard, lease, "queued", error)
            delay = random.uniform(0, min(60.0, 2.0**shard.attempts))
            publish(self.celery, shard.id or 0, countdown_s=delay)
            log.warning("batch shard attempt failed; retrying", error=error, in_s=round(delay, 2))
            return "retrying"

    # --- scoring -----------------------------------------------------------------------

    def _score(
        self, run: BatchRun, shard: BatchShard, lease: Lease
    ) -> tuple[dict[str, list[Any]], list[dict[str, Any]]]:
        spec = BatchSpec.model_validate(run.spec)
        with Session(self.engine) as session:
            tenant = session.get(Tenant, run.tenant_id)
            deployment = session.exec(
                select(Deployment).where(
                    Deployment.tenant_id == run.tenant_id, Deployment.name == run.deployment
                )
            ).first()
            model = session.exec(
                select(Model).where(Model.tenant_id == run.tenant_id, Model.name == run.model)
            ).first()
            version = (
                session.exec(
                    select(ModelVersion).where(
                        ModelVersion.model_id == model.id, ModelVersion.version == run.version
                    )
                ).first()
                if model
                else None
            )
        if tenant is None or version is None:
            raise Fatal(f"model {run.model!r} version {run.version!r} no longer exists")
        batch = PoolPolicy.model_validate(deployment.policy).max_batch_size if deployment else 32
        fmt = datasets.detect_format(shard.input_uri, spec.format)
        try:
            info = open_info(self.settings, shard.input_uri)
            data = datasets.read_object(self.settings, info)
            rows = datasets.parse_rows(data, fmt, info.uri, shard.row_start, shard.row_end)
        except StoreUnavailable as exc:
            raise Retry(exc.detail) from exc
        except (LoaderError, InvalidInput) as exc:
            raise Fatal(f"input {shard.input_uri}: {exc.detail}") from exc
        keys: list[dict[str, Any]] = []
        instances: list[Any] = []
        rejects: list[dict[str, Any]] = []
        for offset, row in enumerate(rows):
            number = shard.row_start + offset
            try:
                if isinstance(row, datasets.BadRow):
                    raise row
                missing = [k for k in spec.key_columns if k not in row]
                if missing:
                    raise datasets.BadRow(f"missing key column(s) {missing}")
                instance = datasets.instance_of(row, spec.input_column, fmt)
                try:
                    results.check_instances([instance], version.input_schema)
                except InvalidInput as exc:
                    raise datasets.BadRow(exc.detail.replace("instances[0]", "the input")) from exc
            except datasets.BadRow as exc:
                rejects.append({"input_uri": shard.input_uri, "row": number, "reason": str(exc)})
                continue
            keys.append({k: row[k] for k in spec.key_columns})
            instances.append(instance)
        limit = spec.max_error_ratio * len(rows)
        if rejects and len(rejects) > limit:
            self._write_rejects(run, shard, rejects)
            raise Fatal(
                f"{len(rejects)} of {len(rows)} rows rejected (max_error_ratio "
                f"{spec.max_error_ratio:g}); first: row {rejects[0]['row']}: "
                f"{rejects[0]['reason']}"
            )
        predictions: list[Any] = []
        for start in range(0, len(instances), batch):
            if lease.lost.is_set():
                raise Lost()
            chunk = instances[start : start + batch]
            predictions.extend(self._predict(run, tenant.name, chunk, lease))
        if lease.lost.is_set():
            raise Lost()
        scored_at = utcnow()
        columns: dict[str, list[Any]] = {k: [r[k] for r in keys] for k in spec.key_columns}
        columns["prediction"] = predictions
        n = len(predictions)
        columns["model"] = [run.model] * n
        columns["version"] = [run.version] * n
        columns["artifact_sha256"] = [run.artifact_sha256] * n
        columns["scored_at"] = [scored_at] * n
        return columns, rejects

    def _predict(self, run: BatchRun, tenant: str, chunk: list[Any], lease: Lease) -> list[Any]:
        path = f"/v1/models/{run.model}/versions/{run.version}:predict"
        body = json.dumps(
            {"instances": chunk, "priority": "batch", "timeout_ms": 120_000},
            separators=(",", ":"),
        ).encode()
        headers = {
            "X-Ember-Tenant": tenant,
            "X-Request-Id": run.uid,
            "Content-Type": "application/json",
        }
        patience = time.monotonic() + WAIT_FOR_CAPACITY_S
        refused = 0
        # The gateway admits batch work only into what online traffic leaves (about one
        # full batch per replica at a time): this worker's shards of one version take
        # turns instead of colliding, and a refusal is retried soon (short, growing,
        # jittered backoff) rather than after the whole Retry-After.
        gate = self._gate(run.model, run.version)
        while True:
            if lease.lost.is_set():
                raise Lost()
            try:
                with gate:
                    response = self.http.post(path, content=body, headers=headers, timeout=130)
            except httpx.HTTPError as exc:
                raise Retry(f"gateway unreachable: {type(exc).__name__}: {exc}") from exc
            if response.status_code == 200:
                doc = response.json()
                if str(doc.get("version")) != run.version:
                    raise Retry(f"the gateway answered from version {doc.get('version')!r}")
                predictions = doc.get("predictions")
                if not isinstance(predictions, list) or len(predictions) != len(chunk):
                    raise Retry("the gateway returned the wrong number of predictions")
                return list(predictions)
            # 429: batch waits while online traffic uses the capacity; 503: no replica is
            # ready yet (scaling up). Neither is the shard's fault: wait, holding the lease.
            if response.status_code in (429, 503) and time.monotonic() < patience:
                try:
                    wait = float(response.headers.get("retry-after") or 1)
                except ValueError:
                    wait = 1.0
                backoff = 0.02 * 2 ** min(refused, 10)
                refused += 1
                time.sleep(random.uniform(0.5, 1.0) * min(max(wait, 0.02), backoff, 10.0))
                continue
            detail = response.text[:500]
            if response.status_code in PERMANENT:
                raise Fatal(f"{response.status_code} from the gateway: {detail}")
            raise Retry(f"{response.status_code} from the gateway: {detail}")

    def _gate(self, model: str, version: str) -> threading.Semaphore:
        with self.lock:
            gate = self.gates.get((model, version))
            if gate is None:
                gate = self.gates[(model, version)] = threading.Semaphore(1)
            return gate

    # --- outcomes ----------------------------------------------------------------------

    def _part(self, run: BatchRun, shard: BatchShard) -> str:
        return f"{run.output_uri}/part-{shard.number:05d}.parquet"

    def _rejects_uri(self, run: BatchRun, shard: BatchShard) -> str:
        return f"{run.output_uri}/rejects/part-{shard.number:05d}.jsonl"

    def _write_rejects(self, run: BatchRun, shard: BatchShard, rejects: list[Any]) -> None:
        data = "".join(json.dumps(r) + "\n" for r in rejects).encode()
        datasets.write_bytes(self.settings, self._rejects_uri(run, shard), data)

    def _commit(
        self,
        run: BatchRun,
        shard: BatchShard,
        lease: Lease,
        columns: dict[str, list[Any]],
        rejects: list[dict[str, Any]],
    ) -> str:
        part = self._part(run, shard)
        try:
            datasets.write_parquet(self.settings, part, columns)
        except Exception:  # predictions of mixed shapes: keep them as JSON text
            columns["prediction"] = [json.dumps(p) for p in columns["prediction"]]
            datasets.write_parquet(self.settings, part, columns)
        if rejects:
            self._write_rejects(run, shard, rejects)
        with Session(self.engine) as session:
            result = session.execute(
                update(BatchShard)
                .where(
                    col(BatchShard.id) == shard.id,
                    col(BatchShard.lease) == lease.token,
                    col(BatchShard.status) == "running",
                )
                .values(
                    status="committed",
                    rows_scored=len(columns["prediction"]),
                    rows_rejected=len(rejects),
                    output_uri=part,
                    rejects_uri=self._rejects_uri(run, shard) if rejects else None,
                    error=None,
                    committed_at=utcnow(),
                    updated_at=utcnow(),
                    lease=None,
                )
            )
            session.commit()
        if getattr(result, "rowcount", 0) != 1:
            # Taken over: the other attempt writes the same object with the same rows.
            log.info("batch shard commit lost the fence (taken over)")
            return "lost"
        log.info("batch shard committed", rows=len(columns["prediction"]), rejects=len(rejects))
        self._finish_if_done(run)
        return "committed"

    def _finish_if_done(self, run: BatchRun) -> None:
        with Session(self.engine) as session:
            shards = session.exec(select(BatchShard).where(BatchShard.run_id == run.id)).all()
            if any(s.status != "committed" for s in shards):
                return
            manifest = {
                "run": run.uid,
                "model": run.model,
                "version": run.version,
                "artifact_sha256": run.artifact_sha256,
                "rows_total": run.rows_total,
                "rows_scored": sum(s.rows_scored for s in shards),
                "rows_rejected": sum(s.rows_rejected for s in shards),
                "parts": [
                    {
                        "shard": s.number,
                        "input_uri": s.input_uri,
                        "rows": [s.row_start, s.row_end],
                        "output_uri": s.output_uri,
                        "rows_scored": s.rows_scored,
                        "rejects_uri": s.rejects_uri,
                    }
                    for s in sorted(shards, key=lambda s: s.number)
                ],
            }
        datasets.write_bytes(
            self.settings,
            f"{run.output_uri}/_manifest.json",
            json.dumps(manifest, indent=1).encode(),
        )
        with Session(self.engine) as session:
            session.execute(
                update(BatchRun)
                .where(col(BatchRun.id) == run.id, col(BatchRun.status) == "running")
                .values(status="succeeded", finished_at=utcnow())
            )
            session.commit()
        log.info("batch run succeeded", rows=manifest["rows_scored"])

    def _settle(self, shard: BatchShard, lease: Lease, status: str, error: str) -> None:
        with Session(self.engine) as session:
            session.execute(
                update(BatchShard)
                .where(col(BatchShard.id) == shard.id, col(BatchShard.lease) == lease.token)
                .values(status=status, error=error[:2000], lease=None, updated_at=utcnow())
            )
            session.commit()

    def _fail_run(self, run: BatchRun, error: str) -> None:
        fail_run(self.engine, run.id or 0, error)

    def close(self) -> None:
        self.http.close()


def fail_run(engine: Engine, run_id: int, error: str) -> None:
    with Session(engine) as session:
        session.execute(
            update(BatchRun)
            .where(col(BatchRun.id) == run_id, col(BatchRun.status) == "running")
            .values(status="failed", error=error[:2000], finished_at=utcnow())
        )
        session.commit()


def open_info(settings: Settings, uri: str) -> ObjectInfo:
    from ember.loader.stores import open_store

    return open_store(uri, settings).stat(uri)


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)


# --- recovery --------------------------------------------------------------------------


def sweep(engine: Engine, settings: Settings, celery: Any) -> int:
    """Republish shards whose worker died (lease expired) or whose message was lost,
    fail runs past their deadline, and top up every running run. Duplicates are harmless
    (a claim is a conditional UPDATE)."""
    now = utcnow()
    stale = now - timedelta(seconds=settings.jobs_republish_after_s)
    republished = 0
    with Session(engine) as session:
        runs = session.exec(select(BatchRun).where(BatchRun.status == "running")).all()
    for run in runs:
        if run.deadline_at is not None and _aware(run.deadline_at) < now:
            fail_run(engine, run.id or 0, "the run passed its deadline")
            continue
        with Session(engine) as session:
            ids = session.exec(
                select(BatchShard.id).where(
                    BatchShard.run_id == run.id,
                    or_(
                        and_(
                            col(BatchShard.status) == "running",
                            col(BatchShard.lease_expires_at) < now,
                        ),
                        and_(
                            col(BatchShard.status) == "queued",
                            col(BatchShard.published_at) < stale,
                        ),
                    ),
                    or_(
                        col(BatchShard.published_at).is_(None),
                        col(BatchShard.published_at)
                        < now - timedelta(seconds=settings.batch_lease_s),
                    ),
                )
            ).all()
            for shard_id in ids:
                session.execute(
                    update(BatchShard)
                    .where(col(BatchShard.id) == shard_id)
                    .values(published_at=now)
                )
            session.commit()
        for shard_id in ids:
            publish(celery, shard_id or 0)
            republished += 1
        republished += pump(engine, celery, run.id or 0)
    return republished


def install(celery: Any, settings: Settings, engine: Engine) -> threading.Thread:
    """Register the shard task on a worker's Celery app; returns the (unstarted) sweep
    thread."""
    runner = ShardRunner(settings, engine, celery)

    def shard(shard_id: object) -> str:
        if not isinstance(shard_id, int) or isinstance(shard_id, bool):
            log.warning("malformed batch shard message dropped", payload=repr(shard_id)[:100])
            return "malformed"
        return runner.run(shard_id)

    options = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True}
    celery.task(name=SHARD_TASK, **options)(shard)

    def loop() -> None:
        while True:
            time.sleep(settings.batch_sweep_interval_s)
            try:
                sweep(engine, settings, celery)
            except Exception as exc:  # the registry or Redis is down: next round
                log.warning("batch sweep failed", error=f"{type(exc).__name__}: {exc}"[:300])

    return threading.Thread(target=loop, name="ember-batch-sweep", daemon=True)


__all__ = ["EmberError", "ShardRunner", "install", "sweep"]
