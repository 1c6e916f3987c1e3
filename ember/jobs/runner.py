"""What a worker does with one job message.

1. **Claim** the job (a fresh lease token; see ``records``). A duplicate or stale
   message claims nothing and is simply acknowledged.
2. Run it through the gateway's data plane over HTTP — ``POST /v1/models/{name}
   [/versions/{v}]:predict`` with ``"priority": "async"``, acting for the job's tenant
   with the worker's admin key — in chunks of at most half the deployment's batch size,
   every chunk on the version the first one ran on. The lease is renewed in the
   background; if it is lost (cancelled, or taken over after a stall) the attempt stops.
3. Write the result, fenced on the lease: inline when small, else to the object store.

Errors (the classes of ``ember.work.failures``):

- **shed** (429: the async class waits while online traffic uses the capacity):
  re-queued after ``Retry-After`` with growing, jittered backoff; not an attempt (a
  backlog is *meant* to wait), bounded by ``EMBER_JOBS_MAX_DEFERRALS``.
- **transient** (502/503/504, 5xx, replica or gateway unreachable, the worker's key
  refused, the attempt over ``EMBER_JOBS_TIMEOUT_S``): re-queued with exponential backoff
  and full jitter; after ``max_attempts`` the job fails with every attempt's error.
- **permanent** (400/404/409/413/422: bad input, unknown or retired version, an input
  object that changed or vanished): the job fails at once with the reason.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlmodel import Session
from structlog.contextvars import bind_contextvars

from ember import tracing
from ember.config import Settings
from ember.errors import EmberError, InvalidInput, LoaderError, StoreUnavailable
from ember.jobs import records, results
from ember.jobs.queue import Publisher
from ember.logs import bound, get_logger, model_context
from ember.registry.tables import Job, Tenant
from ember.work.client import GatewayClient, api_url, worker_id
from ember.work.failures import Permanent, Shed, Transient, classify
from ember.work.lease import Heartbeat

log = get_logger(__name__)
RUNGS = ("model", "cache", "fallback", "default")


@dataclass(frozen=True)
class Answer:
    predictions: list[Any]
    version: str
    rung: str


class DataPlane:
    """The gateway's predict API, called as the job's tenant (admin key + act-as)."""

    def __init__(self, settings: Settings) -> None:
        key = settings.jobs_api_key.get_secret_value() if settings.jobs_api_key else ""
        self.http = GatewayClient(api_url(settings), {"Authorization": f"Bearer {key}"})

    def predict(
        self,
        tenant: str,
        model: str,
        version: str | None,
        instances: list[Any],
        timeout_s: float,
        uid: str,
    ) -> Answer:
        path = f"/v1/models/{model}" + (f"/versions/{version}" if version else "") + ":predict"
        body = {
            "instances": instances,
            "priority": "async",
            "timeout_ms": max(1.0, min(600_000.0, timeout_s * 1000)),
        }
        headers = tracing.inject(
            {"X-Ember-Tenant": tenant, "X-Request-Id": uid, "Content-Type": "application/json"}
        )
        try:
            response = self.http.post(
                path, json.dumps(body).encode(), headers, timeout_s=timeout_s + 5
            )
        except TimeoutError as exc:
            raise Transient(f"no answer from the gateway within {timeout_s:.0f}s") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise Transient(f"gateway unreachable: {type(exc).__name__}: {exc}"[:500]) from exc
        if response.status_code == 200:
            try:
                doc = response.json()
                predictions, served = doc["predictions"], str(doc["version"])
                assert isinstance(predictions, list)
            except (ValueError, KeyError, TypeError, AssertionError) as exc:
                raise Transient("the gateway answered 200 with a malformed body") from exc
            return Answer(predictions, served, response.headers.get("x-ember-rung", "model"))
        detail, code = response.problem()
        try:
            retry_after = float(response.headers.get("retry-after") or 1)
        except ValueError:
            retry_after = 1.0
        raise classify(response.status_code, detail, code, retry_after)

    def close(self) -> None:
        self.http.close()


class Runner:
    def __init__(
        self, settings: Settings, engine: Engine, publisher: Publisher, leases: Heartbeat
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.publisher = publisher
        self.leases = leases
        self.plane = DataPlane(settings)
        self.worker = worker_id()
        self.tenants: dict[int, str] = {}

    # --- one message -----------------------------------------------------------------

    def run(self, uid: str, trace: dict[str, str] | None = None) -> str:
        """Handle one delivery of ``uid``; returns what happened (for logs and tests).
        ``trace``: the trace context its message carried (``ember.tracing.carrier``)."""
        s = self.settings
        outcome = records.claim(self.engine, uid, self.worker, s.jobs_lease_s, s.jobs_result_ttl_s)
        if isinstance(outcome, records.Skip):
            with bound(job_id=uid):
                log.info("job message skipped", reason=outcome.reason)
            if outcome.failed_now and outcome.job is not None and outcome.job.webhook_url:
                self.publisher.webhook(uid)
            return "skipped: " + outcome.reason
        claim = outcome
        job = claim.job
        lost = self.leases.hold(job.id or 0, claim.lease).lost
        try:
            # Until the first chunk answers, an unpinned job's version is the split's choice.
            version = job.version_pinned or job.version or "routed"
            attributes = tracing.model_attributes(job.model, version, job.deployment)
            with (
                model_context(job.model, version, job_id=uid, attempt=claim.number),
                tracing.continued(trace, "job", attributes | {"ember.job": uid}),
            ):
                return self._attempt(claim, lost)
        finally:
            self.leases.release(job.id or 0)

    def _attempt(self, claim: records.Claim, lost: threading.Event) -> str:
        job = claim.job
        try:
            return self._execute(claim, lost)
        except Shed as exc:
            return self._retry(claim, exc.detail, exc.status_code, exc.retry_after_s, True)
        except Transient as exc:
            return self._retry(claim, exc.detail, exc.status_code, 0.0, False)
        except Permanent as exc:
            return self._fail(claim, exc.detail, exc.error_code, exc.status_code)
        except Exception as exc:  # a bug or an unexpected outage: retry, never lose the job
            log.exception("job attempt crashed", model=job.model)
            return self._retry(
                claim, f"internal error: {type(exc).__name__}: {exc}"[:500], None, 0.0, False
            )

    def _execute(self, claim: records.Claim, lost: threading.Event) -> str:
        s = self.settings
        job = claim.job
        deadline = time.monotonic() + s.jobs_timeout_s
        tenant = self._tenant(job.tenant_id)
        instances = self._inputs(job, tenant)
        version, rung = job.version_pinned, "model"
        predictions: list[Any] = []
        for start in range(0, len(instances), max(1, job.chunk_size)):
            if lost.is_set():
                return self._abandon(claim)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Transient(
                    f"the attempt ran over EMBER_JOBS_TIMEOUT_S ({s.jobs_timeout_s:g}s)"
                )
            chunk = instances[start : start + job.chunk_size]
            answer = self.plane.predict(tenant, job.model, version, chunk, remaining, job.uid)
            if len(answer.predictions) != len(chunk):
                raise Transient(
                    f"the gateway returned {len(answer.predictions)} predictions for "
                    f"{len(chunk)} instances"
                )
            if version is None:  # the traffic split chose; every later chunk runs on it
                version = answer.version
                if start + job.chunk_size < len(instances):  # visible while it runs
                    records.set_version(self.engine, job.id or 0, claim.lease, version)
                bind_contextvars(version=version)
                tracing.annotate({"ember.version": version})
            rung = max(rung, answer.rung, key=lambda r: RUNGS.index(r) if r in RUNGS else 0)
            predictions.extend(answer.predictions)
        if lost.is_set():
            return self._abandon(claim)
        return self._store(claim, tenant, version or "", rung, predictions)

    def _inputs(self, job: Job, tenant: str) -> list[Any]:
        if job.inputs is not None:
            return job.inputs
        if job.input_uri is None:
            raise Permanent("the job's inputs were purged", "inputs-purged")
        try:
            data = results.read_bytes(
                self.settings,
                job.input_uri,
                self.settings.jobs_max_input_bytes,
                job.input_etag,
                tenant=tenant,
            )
        except StoreUnavailable as exc:
            raise Transient(f"input_uri: {exc.detail}") from exc
        except LoaderError as exc:  # gone, changed since submit, not allowed any more
            raise Permanent(f"input_uri: {exc.detail}", exc.code, exc.status) from exc
        except EmberError as exc:
            raise Permanent(f"input_uri: {exc.detail}", exc.code, exc.status) from exc
        try:
            return results.parse_instances(data, "input_uri")
        except InvalidInput as exc:
            raise Permanent(exc.detail, exc.code, exc.status) from exc

    def _store(
        self, claim: records.Claim, tenant: str, version: str, rung: str, predictions: list[Any]
    ) -> str:
        s, job = self.settings, claim.job
        data = results.encode_result(predictions)
        digest = results.sha256_hex(data)
        uri = None
        with model_context(job.model, version):
            if len(data) > s.jobs_inline_result_max_bytes:
                uri = results.result_uri(s, tenant, job.model, version, job.uid, claim.number)
                try:
                    results.put_bytes(s, uri, data)
                except StoreUnavailable as exc:
                    raise Transient(f"result upload failed: {exc.detail}") from exc
            written = records.succeed(
                self.engine,
                claim,
                version=version,
                rung=rung,
                result=None if uri else predictions,
                result_uri=uri,
                result_sha256=digest,
                result_bytes=len(data),
                ttl_s=s.jobs_result_ttl_s,
            )
            if not written:
                if uri:  # ours lost the fence: the job has no claim on this object
                    results.delete_object(s, uri)
                log.warning("result discarded: the job was cancelled or taken over")
                return "superseded"
            log.info(
                "job succeeded",
                instances=len(predictions),
                bytes=len(data),
                stored="object" if uri else "inline",
                rung=rung,
            )
        if job.webhook_url:
            self.publisher.webhook(job.uid)
        return "succeeded"

    # --- outcomes --------------------------------------------------------------------

    def _abandon(self, claim: records.Claim) -> str:
        records.abandon(self.engine, claim, "stopped: the job was cancelled or taken over")
        log.info("job attempt stopped: lease lost (cancelled or taken over)")
        return "abandoned"

    def _fail(self, claim: records.Claim, error: str, code: str, status: int | None) -> str:
        s, job = self.settings, claim.job
        if records.fail(
            self.engine,
            claim,
            error=error,
            code=code,
            status_code=status,
            ttl_s=s.jobs_result_ttl_s,
        ):
            log.warning("job failed", error=error, code=code, status_code=status)
            if job.webhook_url:
                self.publisher.webhook(job.uid)
            return "failed"
        return "superseded"

    def _retry(
        self,
        claim: records.Claim,
        error: str,
        status: int | None,
        retry_after_s: float,
        deferral: bool,
    ) -> str:
        s, job = self.settings, claim.job
        if deferral:
            if job.deferrals + 1 > s.jobs_max_deferrals:
                return self._fail(
                    claim,
                    f"shed {job.deferrals + 1} times (online traffic kept "
                    f"the capacity busy); last: {error}",
                    "shed",
                    status,
                )
            cap = min(
                s.jobs_retry_max_backoff_s,
                max(retry_after_s, s.jobs_retry_base_s * 2 ** min(job.deferrals, 16)),
            )
            delay = max(retry_after_s, cap / 2 + random.uniform(0, cap / 2))
        else:
            if job.attempt_count >= job.max_attempts:
                return self._fail(
                    claim,
                    f"gave up after {job.attempt_count} attempts: {error}",
                    "attempts-exhausted",
                    status,
                )
            cap = min(
                s.jobs_retry_max_backoff_s, s.jobs_retry_base_s * 2 ** (job.attempt_count - 1)
            )
            delay = random.uniform(0, cap)
        if not records.release(
            self.engine, claim, error=error, status_code=status, delay_s=delay, deferral=deferral
        ):
            return "superseded"
        if not self.publisher.run(job.uid, job.priority, countdown_s=delay):
            records.unpublish(self.engine, job.id or 0)
        kind = "deferred" if deferral else "retrying"
        log.info(f"job {kind}", error=error, delay_s=round(delay, 3), status_code=status)
        return kind

    def _tenant(self, tenant_id: int) -> str:
        name = self.tenants.get(tenant_id)
        if name is None:
            with Session(self.engine) as session:
                row = session.get(Tenant, tenant_id)
            if row is None:
                raise Permanent("the job's tenant no longer exists", "tenant-gone")
            name = self.tenants[tenant_id] = row.name
        return name

    def close(self) -> None:
        self.plane.close()
