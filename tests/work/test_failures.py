"""``ember.work.failures``: the failure classes sit under ``EmberError`` and an answer of
the data plane maps to the right one."""

from __future__ import annotations

import pytest

from ember.errors import EmberError
from ember.work.client import Reply
from ember.work.failures import (
    PERMANENT_STATUS,
    Lost,
    Permanent,
    Rejected,
    Shed,
    Transient,
    WorkFailure,
    classify,
)


@pytest.mark.parametrize(
    ("cls", "status", "code"),
    [
        (WorkFailure, 500, "work-failed"),
        (Transient, 503, "transient"),
        (Shed, 429, "shed"),
        (Permanent, 422, "permanent"),
        (Rejected, 422, "rejected"),
        (Lost, 409, "lease-lost"),
    ],
)
def test_every_class_is_an_ember_error(cls: type[EmberError], status: int, code: str) -> None:
    assert issubclass(cls, WorkFailure) and issubclass(cls, EmberError)
    assert (cls.status, cls.code) == (status, code)


def test_the_attributes_workers_act_on() -> None:
    shed = Shed("busy", 2.5)
    assert isinstance(shed, Transient)  # a shed answer is worth another try, later
    assert (shed.detail, shed.retry_after_s, shed.status_code) == ("busy", 2.5, 429)
    permanent = Permanent("no such version", "not-found", 404)
    assert (permanent.detail, permanent.error_code, permanent.status_code) == (
        "no such version",
        "not-found",
        404,
    )
    assert str(Transient("boom", 502)) == "boom"
    assert "lease" in Lost().detail
    assert not isinstance(Lost(), (Transient, Permanent))
    assert not isinstance(Rejected("bad row"), Permanent)  # a row's, not the shard's


def test_classify() -> None:
    shed = classify(429, "online first", "back-pressure", 0.0)
    assert isinstance(shed, Shed) and shed.retry_after_s == 0.1  # never a busy loop
    for status in (401, 403):
        refused = classify(status, "bad key", "unauthenticated")
        assert type(refused) is Transient and refused.status_code == status
        assert "API key was refused" in refused.detail
    for status in sorted(PERMANENT_STATUS):
        permanent = classify(status, "no", "invalid-input")
        assert type(permanent) is Permanent
        assert (permanent.error_code, permanent.status_code) == ("invalid-input", status)
    for status in (500, 502, 503, 504, 418):
        transient = classify(status, "down", "engine-error")
        assert type(transient) is Transient and transient.detail == f"{status} engine-error: down"
    assert not {429, 401, 403, 500, 502, 503, 504} & PERMANENT_STATUS


def test_a_problem_answer_is_read() -> None:
    body = b'{"type": "https://ember.dev/problems/invalid-input", "detail": "bad shape"}'
    assert Reply(422, {}, body, "Unprocessable").problem() == ("bad shape", "invalid-input")
    assert Reply(502, {}, b"", "Bad Gateway").problem() == ("Bad Gateway", "http-502")
    assert Reply(500, {}, b"oops", "").problem() == ("oops", "http-500")
