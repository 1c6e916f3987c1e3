"""Ember's error hierarchy. Services raise these; the API maps them to RFC 9457 in one place.

    EmberError                      500  internal
    ├── InvalidInput                422  invalid-input
    │   └── MalformedRequest        400  malformed-request
    ├── Unauthenticated             401  unauthenticated
    ├── Forbidden                   403  forbidden
    │   └── QuotaExceeded           403  quota-exceeded       (carries the quota's name)
    ├── NotFound                    404  not-found
    ├── Conflict                    409  conflict
    ├── PayloadTooLarge             413  payload-too-large
    ├── LoaderError                 422  loader-error
    │   ├── ArtifactError           422  invalid-artifact     (not safetensors, truncated, hostile)
    │   ├── StoreAccessDenied       422  store-access-denied  (outside the allowed roots/buckets)
    │   ├── ObjectNotFound          422  artifact-not-found
    │   ├── ObjectChanged           409  object-changed       (ETag/size moved under us)
    │   ├── StoreUnavailable        503  store-unavailable    (throttled / 5xx after retries)
    │   └── CacheCorrupt            500  cache-corrupt
    ├── CapacityError               503  capacity
    │   └── BackPressure            429  back-pressure        (carries retry_after_s)
    │       └── RateLimited         429  rate-limited         (a key over its request rate)
    ├── EngineError                 502  engine-error
    │   └── NotReady                503  not-ready            (loading, or not hot)
    └── DeadlineExceeded            504  deadline-exceeded    (dropped before compute)

Every error carries a human ``detail`` and optional structured ``extra`` fields that end
up as RFC 9457 extension members, so a client (or the router) can act on them.
"""

from __future__ import annotations

from typing import Any, ClassVar


class EmberError(Exception):
    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal"
    title: ClassVar[str] = "Internal error"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra


class InvalidInput(EmberError):
    status = 422
    code = "invalid-input"
    title = "Invalid input"


class MalformedRequest(InvalidInput):
    status = 400
    code = "malformed-request"
    title = "Malformed request"


class Unauthenticated(EmberError):
    status = 401
    code = "unauthenticated"
    title = "Authentication required"


class Forbidden(EmberError):
    status = 403
    code = "forbidden"
    title = "Forbidden"


class QuotaExceeded(Forbidden):
    """A tenant would hold more than its quota (replicas, GPUs, cores, memory, stored job
    bytes): retrying does not help until it holds less or an admin raises the quota."""

    code = "quota-exceeded"
    title = "Quota exceeded"

    def __init__(self, detail: str, *, quota: str, **extra: Any) -> None:
        super().__init__(detail, quota=quota, **extra)
        self.quota = quota


class NotFound(EmberError):
    status = 404
    code = "not-found"
    title = "Not found"


class Conflict(EmberError):
    status = 409
    code = "conflict"
    title = "Conflict"


class PayloadTooLarge(EmberError):
    status = 413
    code = "payload-too-large"
    title = "Payload too large"


class LoaderError(EmberError):
    status = 422
    code = "loader-error"
    title = "Artifact could not be loaded"


class ArtifactError(LoaderError):
    code = "invalid-artifact"
    title = "Invalid artifact"


class StoreAccessDenied(LoaderError):
    code = "store-access-denied"
    title = "Object store location not allowed"


class ObjectNotFound(LoaderError):
    code = "artifact-not-found"
    title = "Artifact not found"


class ObjectChanged(LoaderError):
    status = 409
    code = "object-changed"
    title = "Object changed while it was read"


class StoreUnavailable(LoaderError):
    status = 503
    code = "store-unavailable"
    title = "Object store unavailable"


class CacheCorrupt(LoaderError):
    status = 500
    code = "cache-corrupt"
    title = "Cache entry corrupt"


class CapacityError(EmberError):
    status = 503
    code = "capacity"
    title = "No capacity"


class BackPressure(CapacityError):
    status = 429
    code = "back-pressure"
    title = "Too many requests"

    def __init__(self, detail: str, *, retry_after_s: float = 1.0, **extra: Any) -> None:
        super().__init__(detail, retry_after_s=retry_after_s, **extra)
        self.retry_after_s = retry_after_s


class RateLimited(BackPressure):
    """A key sent control-plane requests faster than its tenant's rate (``Retry-After``)."""

    code = "rate-limited"
    title = "Rate limit exceeded"


class EngineError(EmberError):
    status = 502
    code = "engine-error"
    title = "Engine error"


class NotReady(EngineError):
    status = 503
    code = "not-ready"
    title = "Replica not ready"


class DeadlineExceeded(EmberError):
    status = 504
    code = "deadline-exceeded"
    title = "Deadline exceeded"


class Upstream(EmberError):
    """A replica's own problem answer, passed through with its status and body."""

    def __init__(self, status: int, body: dict[str, Any], retry_after: str | None = None) -> None:
        super().__init__(str(body.get("detail") or "replica error"))
        self.upstream_status = status
        self.body = body
        self.retry_after = retry_after
