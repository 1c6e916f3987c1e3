"""One trace across three real processes: the API (this process, under uvicorn), an
``ember engine`` replica and an ``ember worker``, each exporting OTLP/HTTP to the test's
receiver (``tests.tracing.receiver``).

A client submits a job with its own ``traceparent``; the job's message carries the
context to a worker, whose call back into the API's data plane carries it on to the
replica. The spans must form one tree in that order, each of the model's work naming the
model and version, and the trace id must be in the prediction log record and in the log
lines of the request and the job."""

from __future__ import annotations

import io
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ember import tracing
from ember.logs import configure_logging
from tests.jobs.conftest import Platform as JobsPlatform
from tests.jobs.conftest import X, live_platform
from tests.tracing.receiver import Receiver, Span, otlp_receiver

MODEL = "slow"
SERVER, CLIENT = 2, 3  # OTLP span kinds


class Platform(JobsPlatform):
    receiver: Receiver
    logs: io.StringIO


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    tmp = tmp_path_factory.mktemp("tracing")
    stream = io.StringIO()
    configure_logging("INFO", "json", stream)  # the API's lines (it runs in this process)
    with otlp_receiver() as receiver, pytest.MonkeyPatch.context() as env:
        otel = {"EMBER_OTEL_ENDPOINT": receiver.url, "EMBER_OTEL_EXPORT_DELAY_MS": "100"}
        for name, value in otel.items():  # the API's settings; replicas inherit EMBER_OTEL_*
            env.setenv(name, value)
        extra = {"prediction_log_window_s": 0.2}
        with live_platform(
            Platform, tmp, MODEL, 0.05, max_batch_size=4, settings_extra=extra, env_extra=otel
        ) as platform:
            platform.receiver, platform.logs = receiver, stream
            yield platform
    configure_logging("INFO", "console")


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def test_a_job_is_one_trace_from_the_client_through_api_worker_and_replica(
    platform: Platform,
) -> None:
    header, trace_id, client_span = traceparent()
    submitted = platform.submit([X, X], model=f"{MODEL}:1", headers={"traceparent": header})
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    done = platform.wait(job_id)
    assert done["status"] == "succeeded", done
    receiver = platform.receiver

    def arrived() -> bool:
        tracing.force_flush()  # the API's spans (this process); the others export on their own
        names = {(s.service, s.name) for s in receiver.of_trace(trace_id)}
        return {("ember-worker", "job"), ("ember-engine", "forward")} <= names

    receiver.wait(arrived)
    spans = receiver.of_trace(trace_id)
    assert {s.service for s in spans} == {"ember-api", "ember-worker", "ember-engine"}

    def one(service: str, name: str | tuple[str, ...], parent: Span | None = None) -> Span:
        names = (name,) if isinstance(name, str) else name
        found = [s for s in spans if s.service == service and s.name in names
                 and (parent is None or s.parent_id == parent.span_id)]  # fmt: skip
        assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
        return found[0]

    # the tree, parent to child, across the three processes
    submit = one("ember-api", "POST /v1/jobs")
    assert submit.parent_id == client_span and submit.kind == SERVER
    enqueue = one("ember-api", "enqueue", submit)
    job = one("ember-worker", "job", enqueue)
    assert job.get("ember.job") == job_id
    # the lean lane's path, or the route's template when the lane left it to the route
    # (the worker key's first call, not yet in the key cache)
    paths = (f"POST /v1/models/{MODEL}/versions/1:predict",
             "POST /v1/models/{name}/versions/{version}:predict")  # fmt: skip
    predict = one("ember-api", paths, job)
    assert predict.kind == SERVER and predict.get("http.response.status_code") == 200
    # the lane's look-up of the key cache, and the route's authentication on a miss
    assert [s for s in spans if s.name == "auth" and s.parent_id == predict.span_id]
    gateway = one("ember-api", "gateway", predict)
    admission = one("ember-api", "admission", gateway)
    route = one("ember-api", "route", gateway)
    hop = one("ember-api", "hop", gateway)
    assert hop.kind == CLIENT
    infer = one("ember-engine", "POST /infer", hop)
    assert infer.kind == SERVER
    queue = one("ember-engine", "queue", infer)
    batch = one("ember-engine", "batch", infer)
    forward = one("ember-engine", "forward", infer)

    # in order: each child inside its parent, the stages one after another
    chain = [submit, enqueue, job, predict, gateway, hop, infer, forward]
    for parent, child in itertools.pairwise(chain):
        if child is job:  # the job runs after its submit's answer
            continue
        assert parent.start_ns <= child.start_ns <= parent.end_ns, child
        if child is not infer:  # a server span ends once its answer is sent: the replica's
            assert child.end_ns <= parent.end_ns, child  # may end after the caller has it
    assert enqueue.end_ns <= job.start_ns
    assert admission.end_ns <= route.start_ns and route.end_ns <= hop.start_ns
    assert queue.end_ns <= batch.start_ns + 1_000 and batch.end_ns <= forward.start_ns + 1_000
    assert forward.end_ns - forward.start_ns >= 50_000_000  # the slow model's 0.05 s pass

    # model and version on every span of the model's work (all but auth, which comes
    # before the request names a deployment); the replica that answered on the hop's
    for span in spans:
        if span.name != "auth":
            assert (span.get("ember.model"), span.get("ember.version")) == (MODEL, "1"), span
    replica = infer.get("ember.replica")
    answered = {s.get("ember.replica") for s in (hop, gateway, route, forward)}
    assert replica and answered == {replica}

    # the trace id in the prediction log record and in the log lines of the request & job
    def predicted() -> list[dict[str, Any]]:
        found = []
        for path in Path(platform.settings.data_dir, "predictions").rglob("*"):
            if path.is_file():
                for line in path.read_text().splitlines():
                    record = json.loads(line)
                    if record.get("trace_id") == trace_id:
                        found.append(record)
        return found

    receiver.wait(lambda: bool(predicted()), 30)
    [record] = predicted()
    assert (record["model"], record["version"], record["replica"]) == (MODEL, "1", replica)
    api_lines = [json.loads(x) for x in platform.logs.getvalue().splitlines() if trace_id in x]
    assert any(line.get("event") == "job queued" for line in api_lines), api_lines
    worker_lines = [json.loads(x) for x in platform.worker_logs(10**7).splitlines()
                    if x.startswith("{") and trace_id in x]  # fmt: skip
    succeeded = [line for line in worker_lines if line.get("event") == "job succeeded"]
    assert succeeded and succeeded[0]["trace_id"] == trace_id and succeeded[0]["job_id"] == job_id


def test_an_online_request_without_traceparent_starts_a_trace_of_its_own(
    platform: Platform,
) -> None:
    response = platform.live.predict(MODEL, 1, timeout_ms=30_000)
    assert response.status_code == 200, response.text
    trace_id = response.headers["traceresponse"].split("-")[1]
    receiver = platform.receiver

    def arrived() -> bool:
        tracing.force_flush()
        return any(s.name == "forward" for s in receiver.of_trace(trace_id))

    receiver.wait(arrived)
    spans = receiver.of_trace(trace_id)
    root = next(s for s in spans if s.parent_id == "")
    assert root.service == "ember-api" and root.name == f"POST /v1/models/{MODEL}:predict"
    infer = next(s for s in spans if s.name == "POST /infer")
    hop = next(s for s in spans if s.span_id == infer.parent_id)
    assert hop.name == "hop" and hop.service == "ember-api"


def test_a_batch_run_s_shards_continue_the_trace_of_the_request_that_made_it(
    platform: Platform,
) -> None:
    header, trace_id, _ = traceparent()
    root = platform.settings.data_dir / "objects" / "batch" / "default"
    source = root / "traced" / "rows.jsonl"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text("".join(json.dumps({"id": i, "features": X}) + "\n" for i in range(8)))
    spec = {"model": MODEL, "input_uri": source.as_uri(), "output_uri": (root / "out").as_uri(),
            "shard_rows": 4, "max_parallel_shards": 1}  # fmt: skip
    started = platform.client.post(
        "/v1/batch/runs", json={"spec": spec}, headers={"traceparent": header}
    )
    assert started.status_code == 202, started.text
    run_id = started.json()["id"]
    receiver = platform.receiver

    def finished() -> bool:
        tracing.force_flush()
        shards = [s for s in receiver.of_trace(trace_id) if s.name == "shard"]
        status = platform.client.get(f"/v1/batch/runs/{run_id}").json()["status"]
        return len(shards) == 2 and status in ("succeeded", "failed")

    receiver.wait(finished, 120)
    assert platform.client.get(f"/v1/batch/runs/{run_id}").json()["status"] == "succeeded"
    receiver.wait(lambda: sum(s.name == "forward" for s in receiver.of_trace(trace_id)) >= 2)
    spans = receiver.of_trace(trace_id)
    by_id = {s.span_id: s for s in spans}
    created = next(s for s in spans if s.name == "POST /v1/batch/runs")
    shards = [s for s in spans if s.name == "shard"]
    # the second shard was published by the worker, after the first: in the run's trace
    # all the same, a child of the request that created the run
    assert [s.parent_id for s in shards] == [created.span_id] * 2
    assert {s.service for s in shards} == {"ember-worker"}
    for shard in shards:
        assert shard.get("ember.batch_run") == run_id
        assert (shard.get("ember.model"), shard.get("ember.version")) == (MODEL, "1")
    for forward in (s for s in spans if s.name == "forward"):
        # up the tree from each forward pass: a replica's server span, then a shard
        ancestors = []
        at = forward
        while at.parent_id in by_id:
            at = by_id[at.parent_id]
            ancestors.append(at.name)
        assert ancestors[0] == "POST /infer" and "shard" in ancestors, ancestors
        assert (forward.get("ember.model"), forward.get("ember.version")) == (MODEL, "1")
