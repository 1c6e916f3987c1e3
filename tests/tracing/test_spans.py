"""Tracing in one process: off by default (no spans, a client's trace id still in the log
lines), and on (a real API exporting OTLP/HTTP to the test's receiver)."""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry import trace

from ember import tracing
from ember.api.app import create_app
from ember.config import Settings
from ember.logs import configure_logging
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.tracing.receiver import Receiver, otlp_receiver

AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


def traceparent() -> tuple[str, str, str]:
    """A client's fresh ``traceparent`` (sampled), its trace id and span id."""
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as found:
        yield found


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    configure_logging("INFO", "json", stream)
    yield stream
    configure_logging("INFO", "console")


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]


def serve(tmp_path: Path, **settings: Any) -> Any:
    config = Settings(data_dir=tmp_path / "data", admin_key=ADMIN_KEY, pools_enabled=False,
                      **settings)  # type: ignore[arg-type]  # fmt: skip
    return services.serve_app(create_app(config))


def test_off_by_default_no_spans_and_a_client_trace_id_still_in_the_logs(
    tmp_path: Path, receiver: Receiver, captured: io.StringIO
) -> None:
    assert Settings().otel_endpoint is None
    header, trace_id, _ = traceparent()
    with serve(tmp_path) as url, httpx.Client(base_url=url, headers=AUTH) as client:
        assert tracing.enabled is False
        # the predict lane (no pools here: a 503 that is logged) with a client's context
        answer = client.post(
            "/v1/models/m:predict", json={"instances": [1]}, headers={"traceparent": header}
        )
        assert answer.status_code == 503, answer.text
        assert "traceresponse" not in answer.headers  # nothing recorded: nothing to name
        # a malformed one is ignored (W3C), never an error
        bad = client.post(
            "/v1/models/m:predict", json={"instances": [1]}, headers={"traceparent": "00-zz-1"}
        )
        assert bad.status_code == 503
        plain = client.post("/v1/models/m:predict", json={"instances": [1]})
        assert plain.status_code == 503
        # spans made with tracing off are not recorded
        with tracing.span("nothing") as span:
            assert not span.is_recording()
            assert tracing.inject({}) == {}
    failed = [line for line in lines(captured) if line.get("event") == "request failed"]
    assert len(failed) == 3, failed
    by_id = {line["request_id"]: line for line in failed}
    assert by_id[answer.headers["x-request-id"]]["trace_id"] == trace_id
    assert "trace_id" not in by_id[bad.headers["x-request-id"]]
    assert "trace_id" not in by_id[plain.headers["x-request-id"]]
    assert receiver.requests == 0 and receiver.spans == []
    # the process-wide OTel provider is never touched: a library's spans stay no-ops
    assert not isinstance(trace.get_tracer_provider(), tracing_sdk_provider())


def tracing_sdk_provider() -> type:
    from opentelemetry.sdk.trace import TracerProvider

    return TracerProvider


def test_on_the_api_continues_a_client_trace_and_exports_it(
    tmp_path: Path, receiver: Receiver, captured: io.StringIO
) -> None:
    header, trace_id, client_span = traceparent()
    settings = {"otel_endpoint": receiver.url, "otel_export_delay_ms": 50,
                "otel_service_name": "api-under-test"}  # fmt: skip
    with serve(tmp_path, **settings) as url, httpx.Client(base_url=url, headers=AUTH) as client:
        assert tracing.enabled is True
        answer = client.post(
            "/v1/models/m:predict", json={"instances": [1]}, headers={"traceparent": header}
        )
        assert answer.status_code == 503
        listed = client.get("/v1/models", headers={"traceparent": header})
        assert listed.status_code == 200
        fresh = client.get("/v1/models")  # no traceparent: a trace of its own
        random_path = f"/v1/{os.urandom(8).hex()}"
        missing = client.get(random_path, headers={"traceparent": header})
        assert missing.status_code == 404
        tracing.force_flush()
        receiver.wait(lambda: len(receiver.of_trace(trace_id)) >= 5)
    assert tracing.enabled is False  # the app's shutdown turned it off again
    spans = receiver.of_trace(trace_id)
    # a path nothing serves is no span name of its own (a scanner's would be thousands)
    [unserved] = [s for s in spans if s.get("url.path") == random_path]
    assert unserved.name == "GET" and unserved.get("http.response.status_code") == 404
    servers = [s for s in spans if s.kind == 2 and s is not unserved]  # SPAN_KIND_SERVER
    # named by the route's template (here the lane left the request to the route)
    assert {s.name for s in servers} == {"POST /v1/models/{name}:predict", "GET /v1/models"}
    for server in servers:
        assert server.parent_id == client_span  # the client's span is the parent
        assert server.service == "api-under-test"
        auth = [s for s in spans if s.name == "auth" and s.parent_id == server.span_id]
        assert len(auth) == 1
        assert server.start_ns <= auth[0].start_ns <= auth[0].end_ns <= server.end_ns
    failed = next(s for s in servers if s.name.startswith("POST"))
    assert failed.get("http.response.status_code") == 503 and failed.status == 2  # ERROR
    listed_span = next(s for s in servers if s.name == "GET /v1/models")
    assert listed_span.get("http.route") == "/v1/models"
    # the answer names the server span (W3C traceresponse)
    assert answer.headers["traceresponse"] == f"00-{trace_id}-{failed.span_id}-01"
    fresh_trace = fresh.headers["traceresponse"].split("-")[1]
    assert fresh_trace != trace_id and receiver.of_trace(fresh_trace)[0].parent_id == ""
    logged = [line for line in lines(captured) if line.get("event") == "request failed"]
    assert [line["trace_id"] for line in logged] == [trace_id]


def test_a_span_inherits_model_attributes_and_records_place_stage_boundaries(
    tmp_path: Path, receiver: Receiver
) -> None:
    settings = Settings(data_dir=tmp_path, otel_endpoint=receiver.url, otel_export_delay_ms=50)
    assert tracing.setup(settings, "unit")
    try:
        with tracing.span("outer", tracing.model_attributes("m", "3", "d", "r-1")) as outer:
            trace_id = tracing.trace_id_of(outer)
            assert trace_id is not None
            carried = tracing.inject({"a": "b"})
            assert carried["a"] == "b" and carried["traceparent"].split("-")[1] == trace_id
            with tracing.span("inner", {"ember.version": "4"}):
                pass
            began = time.monotonic()
            time.sleep(0.02)
            tracing.record("stage", began, began + 0.005)
        tracing.force_flush()
        receiver.wait(lambda: len(receiver.of_trace(trace_id)) == 3)
    finally:
        tracing.shutdown()
    spans = {s.name: s for s in receiver.of_trace(trace_id)}
    outer_span, inner, stage = spans["outer"], spans["inner"], spans["stage"]
    assert inner.parent_id == stage.parent_id == outer_span.span_id
    assert inner.get("ember.model") == "m" and inner.get("ember.replica") == "r-1"
    assert inner.get("ember.version") == "4"  # its own wins over the parent's
    assert stage.get("ember.version") == "3"
    assert stage.end_ns - stage.start_ns == pytest.approx(5_000_000, abs=2_000)
    # placed where the monotonic readings were, not where it was recorded
    assert outer_span.start_ns <= stage.start_ns < inner.start_ns + 25_000_000
    assert stage.end_ns + 15_000_000 <= outer_span.end_ns


def test_job_and_shard_carriers_round_trip_through_celery_headers() -> None:
    """What a Celery task sees of its message's headers (``task.request``) gives back the
    context ``carrier`` put there."""
    header, _, _ = traceparent()

    class Request:
        headers = {"traceparent": header, "tracestate": "k=v", "other": "x"}

    assert tracing.from_task(Request()) == {"traceparent": header, "tracestate": "k=v"}
    assert tracing.from_task(object()) == {}
    with tracing.continued(tracing.from_task(Request()), "job") as span:  # off: passed on
        assert not span.is_recording()
        assert tracing.carrier() == {"traceparent": header, "tracestate": "k=v"}
    assert tracing.carrier() is None


def test_settings_refuse_a_bad_endpoint_and_replicas_never_get_the_export_headers() -> None:
    from pydantic import ValidationError

    from ember.pools.backends.local import replica_environ

    for bad in ("ftp://collector:4318", "collector:4318", "http://"):
        with pytest.raises(ValidationError, match="EMBER_OTEL_ENDPOINT"):
            Settings(otel_endpoint=bad)
    assert Settings(otel_endpoint=" ").otel_endpoint is None
    assert tracing.traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert tracing.traces_url("https://c/v1/traces") == "https://c/v1/traces"
    settings = Settings(otel_headers="x-key=s3cret, x-team = a=b ,,")  # type: ignore[arg-type]
    assert tracing.export_headers(settings) == {"x-key": "s3cret", "x-team": "a=b"}
    environ = {"EMBER_OTEL_ENDPOINT": "http://c:4318", "EMBER_OTEL_SAMPLE_RATIO": "0.5",
               "EMBER_OTEL_HEADERS": "x-key=s3cret"}  # fmt: skip
    assert replica_environ(environ, s3=False) == {
        "EMBER_OTEL_ENDPOINT": "http://c:4318",
        "EMBER_OTEL_SAMPLE_RATIO": "0.5",
    }


def sampled_flag(answer: httpx.Response) -> bool:
    """The W3C sampled bit of an answer's ``traceresponse`` (bit 1 may say "random")."""
    return bool(int(answer.headers["traceresponse"].split("-")[3], 16) & 1)


def test_sampling_applies_to_new_traces_and_a_caller_s_sampled_flag_is_followed(
    tmp_path: Path, receiver: Receiver, captured: io.StringIO
) -> None:
    header, trace_id, _ = traceparent()
    unsampled = f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-00"
    settings = {"otel_endpoint": receiver.url, "otel_sample_ratio": 0.0,
                "otel_export_delay_ms": 50}  # fmt: skip
    with serve(tmp_path, **settings) as url, httpx.Client(base_url=url, headers=AUTH) as client:
        new = client.post("/v1/models/m:predict", json={"instances": [1]})
        declined = client.post(
            "/v1/models/m:predict", json={"instances": [1]}, headers={"traceparent": unsampled}
        )
        sampled = client.post(
            "/v1/models/m:predict", json={"instances": [1]}, headers={"traceparent": header}
        )
        tracing.force_flush()
        receiver.wait(lambda: bool(receiver.of_trace(trace_id)))
    new_trace = new.headers["traceresponse"].split("-")
    assert not sampled_flag(new) and receiver.of_trace(new_trace[1]) == []  # not recorded
    assert not sampled_flag(declined) and receiver.of_trace(unsampled.split("-")[1]) == []
    assert sampled_flag(sampled)
    # recorded or not, every request's lines carry its trace id
    logged = {line["request_id"]: line.get("trace_id") for line in lines(captured)
              if line.get("event") == "request failed"}  # fmt: skip
    assert logged == {
        new.headers["x-request-id"]: new_trace[1],
        declined.headers["x-request-id"]: unsampled.split("-")[1],
        sampled.headers["x-request-id"]: trace_id,
    }
