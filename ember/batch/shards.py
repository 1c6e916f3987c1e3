"""What a worker does with one shard message, and the sweep that recovers lost shards.

1. **Claim**: ``queued`` → ``running`` with a fresh lease token, or take over a
   ``running`` shard whose lease expired (its worker died). A committed shard, a failed
   one or a finished run claims nothing: the message is acknowledged and dropped.
2. **Score** the shard's rows in batches of the deployment's ``max_batch_size``, always
   on the run's pinned version, at the ``batch`` priority: straight to the version's
   replicas (``POST /infer``, tensor body and tensor answer; the gateway's
   ``:batch-lane`` says which replicas and how much in flight, see
   ``ember.batch.client.Lane``), or through the gateway (``POST /v1/models/{m}/versions/
   {v}:predict``, admin key + ``X-Ember-Tenant``) while no replica is ready or reachable
   or ``EMBER_BATCH_DIRECT`` is off. Rows that cannot be scored (unparseable, a missing
   column, the wrong shape) go to the rejects file. The lease is renewed in the
   background; a lost lease stops the attempt.
3. **Write** ``part-NNNNN.parquet`` (one object per shard, written whole and renamed
   into place, so a retry overwrites it with the same rows and no row is ever written
   twice) and ``rejects/part-NNNNN.jsonl``, then **commit** fenced on the lease.
4. The last commit writes ``_manifest.json`` and marks the run succeeded; every commit
   publishes the run's next queued shard.
"""

from __future__ import annotations

import contextvars
import heapq
import http.client
import itertools
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pydantic_core
from sqlalchemy import Engine, and_, or_, update
from sqlmodel import Session, col, select

from ember import tracing
from ember.batch import datasets
from ember.batch.client import InputCache, Lane, Target
from ember.batch.plan import FINISHED, SHARD_TASK, publish, pump, utcnow
from ember.batch.schemas import BatchSpec
from ember.config import Settings
from ember.errors import (
    EmberError,
    InvalidInput,
    LoaderError,
    ObjectChanged,
    StoreUnavailable,
)
from ember.loader.stores import ObjectInfo, open_store
from ember.logs import get_logger, model_context
from ember.registry import catalog
from ember.registry.schemas import PoolPolicy
from ember.registry.tables import BatchRun, BatchShard, Deployment, Model, Tenant
from ember.web.tensorbody import MEDIA_TYPE, TIMEOUT_HEADER, TensorBody, is_tensor
from ember.web.tensorbody import parse as parse_tensor
from ember.work.client import GatewayClient, api_url, worker_id
from ember.work.failures import PERMANENT_STATUS, Lost, Permanent, Transient
from ember.work.lease import Heartbeat, Lease, fence, new_token, takeable

log = get_logger(__name__)
MAX_WINDOW = 64
"""Requests of one version a worker keeps in flight at most (whatever the gateway says)."""
WAIT_FOR_CAPACITY_S = 300.0
"""How long one batch call waits out 429 (shed for online traffic) and 503 (no ready
replica) before the attempt is retried later."""


class ShardRunner:
    def __init__(self, settings: Settings, engine: Engine, celery: Any) -> None:
        self.settings = settings
        self.engine = engine
        self.celery = celery
        key = settings.jobs_api_key.get_secret_value() if settings.jobs_api_key else ""
        self.http = GatewayClient(api_url(settings), {"Authorization": f"Bearer {key}"})
        self.inputs = InputCache()
        self.worker = worker_id()
        self.leases = Heartbeat(engine, BatchShard, settings.batch_lease_s, "ember-batch-lease")
        self.lock = threading.Lock()
        self.windows: dict[tuple[str, str], Window] = {}
        self.lanes: dict[tuple[str, str, str], Lane] = {}
        self.parsing = threading.Lock()
        self.calls = ThreadPoolExecutor(4 * MAX_WINDOW, thread_name_prefix="ember-batch-lane")

    # --- one message -------------------------------------------------------------------

    def run(self, shard_id: int, trace: dict[str, str] | None = None) -> str:
        """One delivery of shard ``shard_id``; ``trace``: its message's trace context (the
        run's: the shard continues it, and publishes the next shards in it)."""
        lease = self.claim(shard_id)
        if lease is None:
            return "skipped"
        with Session(self.engine, expire_on_commit=False) as session:
            shard = session.get(BatchShard, shard_id)
            run = session.get(BatchRun, shard.run_id) if shard else None
        if shard is None or run is None:
            return "skipped"
        self.leases.keep(lease)
        try:
            attributes = tracing.model_attributes(run.model, run.version)
            with (
                model_context(run.model, run.version, run_id=run.uid, shard=shard.number),
                tracing.continued(trace, "shard", attributes | {"ember.batch_run": run.uid}),
            ):
                return self._attempt(run, shard, lease)
        finally:
            self.leases.release(lease.row_id)
            with tracing.attached(trace):
                pump(self.engine, self.celery, run.id or 0)

    def claim(self, shard_id: int) -> Lease | None:
        s = self.settings
        token = new_token()
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
                .where(col(BatchShard.id) == shard_id, takeable(BatchShard, now))
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
        return Lease(shard_id, token)

    def _attempt(self, run: BatchRun, shard: BatchShard, lease: Lease) -> str:
        try:
            if run.deadline_at is not None and _aware(run.deadline_at) < utcnow():
                self._fail_run(run, "the run passed its deadline")
                raise Permanent("the run passed its deadline")
            scored, rejects = self._score(run, shard, lease)
            return self._commit(run, shard, lease, scored, rejects)
        except Lost:
            log.info("batch shard attempt stopped: lease lost (taken over)")
            return "lost"
        except Permanent as exc:
            self._settle(shard, lease, "failed", str(exc))
            self._fail_run(run, f"shard {shard.number} failed: {exc}")
            log.warning("batch shard failed", error=str(exc))
            return "failed"
        except Exception as exc:  # Transient, an outage or a bug: try again, never lose rows
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
    ) -> tuple[Any, list[dict[str, Any]]]:
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
            version = catalog.find_version(session, model, run.version) if model else None
        if tenant is None or version is None:
            raise Permanent(f"model {run.model!r} version {run.version!r} no longer exists")
        batch = PoolPolicy.model_validate(deployment.policy).max_batch_size if deployment else 32
        fmt = datasets.detect_format(shard.input_uri, spec.format)
        try:
            rows = self._read(shard, fmt, spec, version.input_schema)
        except StoreUnavailable as exc:
            raise Transient(exc.detail) from exc
        except ObjectChanged as exc:
            raise Permanent(
                f"input {shard.input_uri} changed since the run was planned: {exc.detail}"
            ) from exc
        except (LoaderError, InvalidInput) as exc:
            raise Permanent(f"input {shard.input_uri}: {exc.detail}") from exc
        rejects = [{"input_uri": shard.input_uri, **r} for r in rows.rejects]
        limit = spec.max_error_ratio * rows.total
        if rejects and len(rejects) > limit:
            self._write_rejects(run, shard, rejects)
            raise Permanent(
                f"{len(rejects)} of {rows.total} rows rejected (max_error_ratio "
                f"{spec.max_error_ratio:g}); first: row {rejects[0]['row']}: "
                f"{rejects[0]['reason']}"
            )
        predictions = self._predict_all(run, tenant.name, rows.instances, batch, lease)
        if lease.lost.is_set():
            raise Lost()
        return _output(run, rows.keys, predictions, utcnow()), rejects

    def _read(
        self, shard: BatchShard, fmt: str, spec: BatchSpec, schema: dict[str, Any] | None
    ) -> datasets.ShardRows:
        """The shard's rows, from the object as it was when the run was planned
        (``ObjectChanged`` otherwise). A JSONL shard with a planned byte range reads just
        its bytes (one ranged read; its rows are numbered from ``row_start`` all the
        same); other shards read the whole object, shared through the worker's input
        cache. Shards fetch their bytes at once but parse one at a time: parsing holds
        the GIL, and four shards parsed together made the first one ready four times
        later (the model idle until then) for no gain."""
        expected = shard.row_end - shard.row_start
        if shard.byte_start is not None and shard.byte_end is not None and fmt == "jsonl":
            length = shard.byte_end - shard.byte_start
            store = open_store(shard.input_uri, self.settings)
            data = store.read_range(
                shard.input_uri, shard.byte_start, length, etag=shard.input_etag
            )
            with self.parsing:
                rows = datasets.read_shard(
                    data, fmt, shard.input_uri, 0, expected, spec.key_columns,
                    spec.input_column, schema, first_line=shard.line_start or 1,
                )  # fmt: skip
            if rows.total != expected:
                raise ObjectChanged(f"its bytes now hold {rows.total} rows, not {expected}")
            for reject in rows.rejects:
                reject["row"] += shard.row_start
            return rows
        info = open_info(self.settings, shard.input_uri)
        if shard.input_etag is not None and info.etag != shard.input_etag:
            raise ObjectChanged(f"etag {info.etag} != {shard.input_etag}")
        data, memo = self.inputs.get(info, lambda i: datasets.read_object(self.settings, i))
        with self.parsing:
            return datasets.read_shard(
                data, fmt, info.uri, shard.row_start, shard.row_end, spec.key_columns,
                spec.input_column, schema, memo,
            )  # fmt: skip

    def _predict_all(
        self, run: BatchRun, tenant: str, instances: Any, batch: int, lease: Lease
    ) -> Any:
        """Predictions for ``instances`` (in order; a list, or one array when replicas
        answered with tensors), in requests of ``batch`` (the deployment's
        ``max_batch_size``), several in flight: as many as fit in the batch class's
        window (the lane's windows on the replicas, or the gateway's
        ``X-Ember-Batch-Window``: two full batches per replica), so a replica always has
        this version's next batch queued behind the one it computes.

        The window is shared by this worker's shards of the version, first come first
        served: the shard that started first has it until it is done, while the others
        wait with their rows read. Shards then finish one after another, and a shard's
        start (claim, read) overlaps the others' scoring instead of leaving the replica
        idle between waves of shards. Each of the shard's lanes sends its next request
        as soon as one of its own comes back."""
        window = self._window(run.model, run.version)
        direct = self._lane(tenant, run)
        if direct is not None:
            direct.refresh()
            window.resize_to(direct.window(), batch)
        ticket = window.ticket()
        starts = range(0, len(instances), batch)
        results: list[Any] = [[] for _ in starts]
        taken = itertools.count()  # the next request's index, for whichever lane is free
        stop = threading.Event()

        errors: list[BaseException] = []

        def lane() -> None:
            held = False  # a window slot, kept from one request to the next
            try:
                while not stop.is_set():
                    i = next(taken)
                    if i >= len(starts):
                        return
                    while not held:
                        held = window.acquire(ticket, timeout=0.5)
                        if not held and (lease.lost.is_set() or stop.is_set()):
                            raise Lost()
                    chunk = instances[starts[i] : starts[i] + batch]
                    results[i] = self._call(run, tenant, chunk, lease, stop, window, batch, direct)
                    if window.yields(ticket):
                        window.release()
                        held = False
            except BaseException as exc:  # the shard's failure: the other lanes stop
                errors.append(exc)
                stop.set()
            finally:
                if held:
                    window.release()

        lanes = [
            self.calls.submit(contextvars.copy_context().run, lane)  # logs keep the context
            for _ in range(min(len(starts), max(2, window.size)) - 1)
        ]
        lane()
        wait(lanes)
        if errors:  # the cause, not the lanes it stopped (Lost), unless the lease was lost
            raise next((e for e in errors if not isinstance(e, Lost)), errors[0])
        return _joined(results)

    def _call(
        self,
        run: BatchRun,
        tenant: str,
        chunk: Any,
        lease: Lease,
        stop: threading.Event,
        window: Window,
        batch: int,
        lane: Lane | None,
    ) -> Any:
        """The predictions for ``chunk``: a list, or an array when a replica answered
        with a tensor."""
        path = f"/v1/models/{run.model}/versions/{run.version}:predict"
        headers = tracing.inject({"X-Ember-Tenant": tenant, "X-Request-Id": run.uid})
        if isinstance(chunk, np.ndarray):  # a tensor body: no JSON on the way to the model
            tensor = TensorBody.of(chunk)
            body = tensor.data
            headers |= {
                "Content-Type": tensor.content_type,
                "X-Ember-Priority": "batch",
                TIMEOUT_HEADER: "120000",
            }
        else:
            body = json.dumps(
                {"instances": chunk, "priority": "batch", "timeout_ms": 120_000},
                separators=(",", ":"),
            ).encode()
            headers["Content-Type"] = "application/json"
        patience = time.monotonic() + WAIT_FOR_CAPACITY_S
        refused = 0
        while True:
            if lease.lost.is_set() or stop.is_set():
                raise Lost()
            target: Target | None = None
            if lane is not None:
                lane.refresh()
                target = lane.take()
            if target is not None:
                assert lane is not None
                response = self._direct(lane, target, body, headers, len(chunk))
                if response is None:
                    continue  # that replica is out of the lane now: the next one, or :predict
                window.resize_to(lane.window(), batch)
            else:
                try:
                    response = self.http.post(path, body, headers)
                except (OSError, http.client.HTTPException) as exc:
                    raise Transient(f"gateway unreachable: {type(exc).__name__}: {exc}") from exc
                if response.status_code == 200:
                    window.resize(response.headers.get("x-ember-batch-window"), batch)
            if response.status_code == 200:
                return _predictions(run, response, len(chunk))
            # 429: batch waits while online traffic uses the capacity; 503: no replica is
            # ready yet (scaling up). Neither is the shard's fault: wait, holding the lease
            # (and the window slot: the window does not grow into capacity online uses).
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
            source = "a replica" if target is not None else "the gateway"
            if response.status_code in PERMANENT_STATUS:
                raise Permanent(f"{response.status_code} from {source}: {detail}")
            raise Transient(f"{response.status_code} from {source}: {detail}")

    def _direct(
        self, lane: Lane, target: Target, body: bytes, headers: dict[str, str], rows: int
    ) -> Any:
        """One batch straight to a replica of the lane; None when the replica cannot be
        reached or is not serving (not ready, draining: 503), which leaves it out of the
        lane until the gateway names it again."""
        try:
            response = target.client.post("/infer", body, headers | DIRECT_HEADERS)
        except (OSError, http.client.HTTPException) as exc:
            lane.done(target, 0, ok=False)
            log.warning(
                "batch lane: replica unreachable, left out",
                replica=target.replica_id,
                url=target.url,
                error=f"{type(exc).__name__}: {exc}"[:200],
            )
            return None
        if response.status_code == 503:
            lane.done(target, 0, ok=False)
            return None
        lane.done(target, rows if response.status_code == 200 else 0, ok=True)
        return response

    def _lane(self, tenant: str, run: BatchRun) -> Lane | None:
        if not self.settings.batch_direct:
            return None
        key = (tenant, run.model, run.version)
        with self.lock:
            lane = self.lanes.get(key)
            if lane is None:
                lane = self.lanes[key] = Lane(self.http, tenant, run.model, run.version)
            return lane

    def _window(self, model: str, version: str) -> Window:
        with self.lock:
            window = self.windows.get((model, version))
            if window is None:
                window = self.windows[(model, version)] = Window()
            return window

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
        table: Any,
        rejects: list[dict[str, Any]],
    ) -> str:
        part = self._part(run, shard)
        datasets.write_table(self.settings, part, table)
        if rejects:
            self._write_rejects(run, shard, rejects)
        with Session(self.engine) as session:
            result = session.execute(
                update(BatchShard)
                .where(fence(BatchShard, shard.id or 0, lease.token))
                .values(
                    status="committed",
                    rows_scored=table.num_rows,
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
        log.info("batch shard committed", rows=table.num_rows, rejects=len(rejects))
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
        self.calls.shutdown(wait=False, cancel_futures=True)
        self.leases.stop.set()
        self.http.close()
        with self.lock:
            lanes = list(self.lanes.values())
        for lane in lanes:
            lane.close()


DIRECT_HEADERS = {"Accept": MEDIA_TYPE}
"""What a direct batch call adds: a tensor answer, when the predictions make one."""


def _predictions(run: BatchRun, response: Any, rows: int) -> Any:
    """The predictions of a 200 answer (a tensor answer as an array), checked: the run's
    version, one per row; ``Transient`` otherwise."""
    ctype = response.headers.get("content-type")
    if is_tensor(ctype):
        answered = response.headers.get("x-ember-version")
        if answered != run.version:
            raise Transient(f"a replica answered from version {answered!r}")
        try:
            array = parse_tensor(str(ctype), response.content, max(1, rows)).array()
        except EmberError as exc:
            raise Transient(f"an unreadable tensor answer: {exc.detail}") from exc
        if array.shape[0] != rows:
            raise Transient("a replica returned the wrong number of predictions")
        return array
    doc = pydantic_core.from_json(response.content)  # ~6x json.loads here
    if not isinstance(doc, dict) or str(doc.get("version")) != run.version:
        version = doc.get("version") if isinstance(doc, dict) else None
        raise Transient(f"the answer came from version {version!r}")
    predictions = doc.get("predictions")
    if not isinstance(predictions, list) or len(predictions) != rows:
        raise Transient("the answer has the wrong number of predictions")
    return predictions


def _joined(results: list[Any]) -> Any:
    """The chunks' predictions in order: one array when every chunk is an array of one
    row shape, else one list."""
    arrays = results and all(isinstance(r, np.ndarray) for r in results)
    if arrays and len({r.shape[1:] for r in results}) == 1:
        return np.concatenate(results)
    return [
        p for chunk in results for p in (chunk.tolist() if isinstance(chunk, np.ndarray) else chunk)
    ]


def _output(run: BatchRun, keys: dict[str, Any], predictions: Any, at: datetime) -> Any:
    """The shard's output table: the key columns, ``prediction`` (a fixed-size list
    column when the predictions are numeric arrays of one shape; JSON text when they do
    not fit one Arrow type), ``model``, ``version``, ``artifact_sha256``, ``scored_at``."""
    import pyarrow as pa

    n = len(predictions)
    try:
        prediction = _prediction_column(predictions)
    except (pa.ArrowException, ValueError, TypeError, OverflowError):
        rows = predictions.tolist() if isinstance(predictions, np.ndarray) else predictions
        prediction = pa.array([json.dumps(p) for p in rows], pa.string())
    columns = dict(keys) | {
        "prediction": prediction,
        "model": pa.repeat(pa.scalar(run.model, pa.string()), n),
        "version": pa.repeat(pa.scalar(run.version, pa.string()), n),
        "artifact_sha256": pa.repeat(pa.scalar(run.artifact_sha256, pa.string()), n),
        "scored_at": pa.repeat(pa.scalar(at, pa.timestamp("us", tz="UTC")), n),
    }
    return pa.table(columns)


def _prediction_column(predictions: Any) -> Any:
    """A fixed-size list column for numeric arrays of one shape (a tensor answer, or
    lists that make one), else whatever pyarrow makes of the values."""
    import pyarrow as pa

    array = predictions if isinstance(predictions, np.ndarray) else None
    if array is None and predictions and isinstance(predictions[0], list):
        try:
            array = np.asarray(predictions)
        except ValueError:  # ragged
            array = None
    if array is not None and array.ndim >= 2 and array.dtype.kind in "biuf":
        column = pa.array(array.reshape(-1))
        for size in reversed(array.shape[1:]):
            column = pa.FixedSizeListArray.from_arrays(column, size)
        return column
    return pa.array(predictions)


class Window:
    """A resizable semaphore, served in ticket order: the requests of one version a
    worker keeps in flight, first to the shards that started first."""

    def __init__(self, size: int = 1) -> None:
        self.size = size
        self.active = 0
        self.cond = threading.Condition()
        self.waiting: list[int] = []
        self.tickets = itertools.count()

    def ticket(self) -> int:
        with self.cond:
            return next(self.tickets)

    def acquire(self, ticket: int, timeout: float) -> bool:
        with self.cond:
            heapq.heappush(self.waiting, ticket)
            try:
                free = self.cond.wait_for(
                    lambda: self.active < self.size and self.waiting[0] == ticket, timeout
                )
            finally:
                self.waiting.remove(ticket)
                heapq.heapify(self.waiting)
            if free:
                self.active += 1
            else:
                self.cond.notify_all()  # it may have been first in line
            return free

    def release(self) -> None:
        with self.cond:
            self.active -= 1
            self.cond.notify_all()

    def yields(self, ticket: int) -> bool:
        """Whether a holder should give its slot back: the window shrank, or a shard
        that started earlier waits."""
        with self.cond:
            return self.active > self.size or bool(self.waiting and self.waiting[0] < ticket)

    def resize(self, header: str | None, batch: int) -> None:
        """Adopt the gateway's ``X-Ember-Batch-Window`` (instances; absent or malformed:
        no change) as requests of ``batch`` instances."""
        if header is None or not header.isascii() or not header.isdigit() or len(header) > 9:
            return
        self.resize_to(int(header), batch)

    def resize_to(self, instances: int, batch: int) -> None:
        """A window of ``instances`` (0: no change) as requests of ``batch`` instances."""
        if instances <= 0:
            return
        size = max(1, min(MAX_WINDOW, instances // max(1, batch)))
        if size != self.size:
            with self.cond:
                self.size = size
                self.cond.notify_all()


def fail_run(engine: Engine, run_id: int, error: str) -> None:
    with Session(engine) as session:
        session.execute(
            update(BatchRun)
            .where(col(BatchRun.id) == run_id, col(BatchRun.status) == "running")
            .values(status="failed", error=error[:2000], finished_at=utcnow())
        )
        session.commit()


def open_info(settings: Settings, uri: str) -> ObjectInfo:
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
    # The readers shards use, imported now: not by the first shard, on a run's clock.
    import pyarrow.compute
    import pyarrow.json
    import pyarrow.parquet  # noqa: F401

    runner = ShardRunner(settings, engine, celery)

    def shard(task: Any, shard_id: object) -> str:
        if not isinstance(shard_id, int) or isinstance(shard_id, bool):
            log.warning("malformed batch shard message dropped", payload=repr(shard_id)[:100])
            return "malformed"
        return runner.run(shard_id, tracing.from_task(task.request))

    options = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True}
    celery.task(name=SHARD_TASK, bind=True, **options)(shard)

    def loop() -> None:
        while True:
            time.sleep(settings.batch_sweep_interval_s)
            runner.inputs.trim()
            try:
                sweep(engine, settings, celery)
            except Exception as exc:  # the registry or Redis is down: next round
                log.warning("batch sweep failed", error=f"{type(exc).__name__}: {exc}"[:300])

    return threading.Thread(target=loop, name="ember-batch-sweep", daemon=True)


__all__ = ["EmberError", "ShardRunner", "install", "sweep"]
