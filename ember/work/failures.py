"""How a unit of work (a job attempt, a batch shard) can fail, as ``EmberError``\\ s.

A worker decides what to do with a failure by its class, never by parsing a message:

    WorkFailure              500  work-failed
    ├── Transient            503  transient    try again later (counts as an attempt)
    │   └── Shed             429  shed         online traffic has the capacity: wait
    │                                          ``retry_after_s`` (not an attempt)
    ├── Permanent            422  permanent    cannot succeed: fail now, with the reason
    ├── Lost                 409  lease-lost   the lease is another worker's now: stop,
    │                                          write nothing
    └── Rejected             422  rejected     one input row that cannot be scored: it
                                               goes to the rejects file, the rest of
                                               the shard goes on (not the work's failure)

They are internal to the workers (the API never raises them), but as ``EmberError``\\ s
they carry a ``detail`` and render as RFC 9457 problems like every other error should one
escape. ``status_code`` is the HTTP status the data plane answered, when there was one;
``error_code`` is the reason a job records (``Job.error_code``).

``PERMANENT_STATUS``: the data-plane answers that no retry can fix (bad input, unknown
or retired version, an object that changed). ``classify`` maps an answer to its class.
"""

from __future__ import annotations

from typing import Any

from ember.errors import EmberError

PERMANENT_STATUS = frozenset({400, 404, 405, 409, 410, 413, 415, 422})


class WorkFailure(EmberError):
    status = 500
    code = "work-failed"
    title = "Work failed"

    def __init__(self, detail: str, status_code: int | None = None, **extra: Any) -> None:
        super().__init__(detail, **extra)
        self.status_code = status_code


class Transient(WorkFailure):
    """Worth another attempt: 5xx, unreachable, timed out, the worker's key refused."""

    status = 503
    code = "transient"
    title = "Transient failure"


class Shed(Transient):
    """429: the work's priority class waits while online traffic uses the capacity."""

    status = 429
    code = "shed"
    title = "Shed for online traffic"

    def __init__(self, detail: str, retry_after_s: float = 1.0, **extra: Any) -> None:
        super().__init__(detail, 429, **extra)
        self.retry_after_s = retry_after_s


class Permanent(WorkFailure):
    """No retry can fix it; ``error_code`` says why (e.g. the data plane's problem type)."""

    status = 422
    code = "permanent"
    title = "Permanent failure"

    def __init__(
        self,
        detail: str,
        error_code: str = "permanent",
        status_code: int | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail, status_code, **extra)
        self.error_code = error_code


class Rejected(WorkFailure):
    """One input row that cannot be scored; its reason goes to the rejects file."""

    status = 422
    code = "rejected"
    title = "Row rejected"


class Lost(WorkFailure):
    """The lease was lost (cancelled, or taken over after a stall): stop, write nothing."""

    status = 409
    code = "lease-lost"
    title = "Lease lost"

    def __init__(self, detail: str = "the lease was lost: another worker owns the work") -> None:
        super().__init__(detail)


def classify(
    status_code: int, detail: str, error_code: str, retry_after_s: float = 1.0
) -> WorkFailure:
    """The failure a data-plane answer other than 200 means."""
    if status_code == 429:
        return Shed(f"shed ({detail})", max(0.1, retry_after_s))
    if status_code in (401, 403):
        return Transient(f"the worker's API key was refused ({status_code}): {detail}", status_code)
    if status_code in PERMANENT_STATUS:
        return Permanent(detail, error_code, status_code)
    return Transient(f"{status_code} {error_code}: {detail}", status_code)
