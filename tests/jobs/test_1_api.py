"""The jobs API end to end: submit → result, idempotency, cancel, quota, bad input,
webhooks and result retention — through real workers, Redis and a replica."""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sqlmodel import Session, select

from ember.api.app import create_app
from ember.config import Settings
from ember.errors import InvalidInput
from ember.jobs import records, webhooks
from ember.jobs.queue import Publisher
from ember.jobs.schemas import job_document
from ember.jobs.sweeper import Sweeper
from ember.registry.db import make_engine
from ember.registry.tables import Job
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.jobs.conftest import MODEL, Platform, X

Y = [0.25] * 256


def canonical(predictions: list[Any]) -> bytes:
    return json.dumps({"predictions": predictions}, separators=(",", ":")).encode()


def test_round_trip_inline_and_large_results(platform: Platform) -> None:
    small = platform.submit([X])
    assert small.status_code == 202, small.text
    assert small.headers["location"] == f"/v1/jobs/{small.json()['id']}"
    large = platform.submit([X, Y, X, Y], model=f"{MODEL}:production", priority=9)
    assert large.status_code == 202, large.text

    done = platform.wait(small.json()["id"])
    assert done["status"] == "succeeded", done
    assert (done["model"], done["deployment"], done["version"]) == (MODEL, MODEL, "1")
    online = platform.online(1)  # the same weights answer the same (up to batch rounding)
    assert np.allclose(done["result"]["predictions"], online, rtol=1e-4, atol=1e-6)
    digest = hashlib.sha256(canonical(done["result"]["predictions"])).hexdigest()
    assert done["result_sha256"] == digest
    # One attempt; before it, possibly deferrals (the async class is shed while another
    # job's chunk holds its share of the replica), which do not count as attempts.
    outcomes = [a["outcome"] for a in done["attempts"]]
    assert outcomes[-1] == "succeeded" and set(outcomes[:-1]) <= {"deferred"}, outcomes
    assert done["attempt_count"] == 1 and done["deferrals"] == len(outcomes) - 1
    assert done["started_at"] and done["finished_at"]

    big = platform.wait(large.json()["id"])
    assert big["status"] == "succeeded" and big["version_ref"] == "production", big
    assert big["version"] == "1" and big["result"] is None
    # Large results live in the object store under model, version and job id.
    stored = platform.live.store / "job-results" / "default" / MODEL / "1" / big["id"]
    assert big["result_uri"].startswith(stored.as_uri() + "/")
    body = Path(big["result_uri"].removeprefix("file://")).read_bytes()
    assert hashlib.sha256(body).hexdigest() == big["result_sha256"]
    predictions = json.loads(body)["predictions"]
    assert len(predictions) == 4
    assert np.allclose(predictions[0], online[0], rtol=1e-4, atol=1e-6)
    fetched = platform.client.get(f"/v1/jobs/{big['id']}/result")
    assert fetched.content == body
    assert fetched.headers["x-ember-result-sha256"] == big["result_sha256"]
    assert platform.client.get(f"/v1/jobs/{done['id']}/result").json() == done["result"]


def test_input_uri_and_listing(platform: Platform) -> None:
    inputs = platform.live.store / "job-inputs" / "default" / "batch.json"
    inputs.parent.mkdir(parents=True, exist_ok=True)
    inputs.write_text(json.dumps({"instances": [Y, X]}))
    response = platform.submit(input_uri=inputs.as_uri(), model=f"{MODEL}:1")
    assert response.status_code == 202, response.text
    done = platform.wait(response.json()["id"])
    assert done["status"] == "succeeded" and done["input_uri"] == inputs.as_uri(), done
    assert done["instances"] == 2 and done["version_ref"] == "1"

    listed = platform.client.get("/v1/jobs", params={"status": "succeeded", "model": MODEL})
    assert listed.status_code == 200
    ids = [j["id"] for j in listed.json()["items"]]
    assert done["id"] in ids and all(j["status"] == "succeeded" for j in listed.json()["items"])
    first = platform.client.get("/v1/jobs", params={"limit": 1}).json()
    assert len(first["items"]) == 1 and first["next_cursor"]
    second = platform.client.get("/v1/jobs", params={"limit": 1, "cursor": first["next_cursor"]})
    assert second.json()["items"][0]["id"] != first["items"][0]["id"]
    assert platform.client.get("/v1/jobs", params={"model": "other"}).json()["items"] == []
    # Another tenant sees none of it.
    platform.client.post("/v1/tenants", json={"name": "other-team"})
    key = platform.client.post("/v1/keys", json={"name": "k", "tenant": "other-team"}).json()
    other = httpx.Client(
        base_url=platform.live.url, headers={"Authorization": f"Bearer {key['key']}"}
    )
    assert other.get("/v1/jobs").json()["items"] == []
    assert other.get(f"/v1/jobs/{done['id']}").status_code == 404
    assert other.delete(f"/v1/jobs/{done['id']}").status_code == 404
    other.close()


def test_idempotency_key(platform: Platform) -> None:
    headers = {"Idempotency-Key": "order-42"}
    first = platform.submit([X], headers=headers)
    again = platform.submit([X], headers=headers)
    assert first.status_code == again.status_code == 202, again.text
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    other = platform.submit([Y], headers=headers)
    assert other.status_code == 409, other.text
    assert other.headers["content-type"].startswith("application/problem+json")
    assert first.json()["id"] in other.json()["detail"]

    # Racing submissions with one key make one job.
    race = {"Idempotency-Key": "race-7"}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: platform.submit([Y], headers=race), range(6)))
    assert {a.status_code for a in answers} == {202}, [a.text for a in answers]
    assert len({a.json()["id"] for a in answers}) == 1
    assert platform.wait(first.json()["id"])["status"] == "succeeded"


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"model": MODEL, "inputs": {"instances": [[1, 2]]}}, 422, "shape"),
        ({"model": MODEL, "inputs": {"instances": [X, "nope"]}}, 422, "instances[1]"),
        ({"model": MODEL, "inputs": {"instances": []}}, 422, "instances"),
        ({"model": MODEL}, 422, "exactly one"),
        ({"model": MODEL, "inputs": {"instances": [X]}, "input_uri": "file:///x"}, 422, "one"),
        ({"model": "nope", "inputs": {"instances": [X]}}, 404, "nope"),
        ({"model": f"{MODEL}:7", "inputs": {"instances": [X]}}, 404, "'7'"),
        ({"model": f"{MODEL}:2", "inputs": {"instances": [X]}}, 404, "not served"),
        ({"model": "Bad Name!", "inputs": {"instances": [X]}}, 422, "model"),
        ({"model": MODEL, "inputs": {"instances": [X]}, "priority": 10}, 422, "priority"),
        ({"model": MODEL, "inputs": {"instances": [X]}, "extra": 1}, 422, "extra"),
        ({"model": MODEL, "input_uri": "file:///etc/passwd"}, 422, "job-inputs"),
        ({"model": MODEL, "inputs": {"instances": [X]}, "webhook_url": "ftp://x"}, 422, "http"),
    ],
)
def test_bad_input_is_refused_at_submit(
    platform: Platform, body: dict[str, Any], status: int, says: str
) -> None:
    before = len(platform.client.get("/v1/jobs", params={"limit": 500}).json()["items"])
    response = platform.client.post("/v1/jobs", json=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    problem = response.json()
    assert problem["status"] == status and says in json.dumps(problem), problem
    assert len(platform.client.get("/v1/jobs", params={"limit": 500}).json()["items"]) == before


def test_malformed_requests_are_problems(platform: Platform) -> None:
    raw = platform.client.post(
        "/v1/jobs",
        content=b'{"model": "slow", "inputs": ',
        headers={"content-type": "application/json"},
    )
    assert raw.status_code == 400 and raw.json()["title"] == "Malformed request"
    assert platform.client.get("/v1/jobs/job_nothex").status_code == 422
    missing = platform.client.get("/v1/jobs/job_" + "0" * 24)
    assert missing.status_code == 404 and missing.json()["type"].endswith("/not-found")
    bad_cursor = platform.client.get("/v1/jobs", params={"cursor": "garbage"})
    assert bad_cursor.status_code == 422
    too_long = platform.submit([X], headers={"Idempotency-Key": "k" * 300})
    assert too_long.status_code == 422
    missing_input = platform.submit(
        input_uri=(platform.live.store / "job-inputs" / "default" / "absent.json").as_uri()
    )
    assert missing_input.status_code == 422 and "no object" in missing_input.json()["detail"]
    bad_json = platform.live.store / "job-inputs" / "default" / "bad.json"
    bad_json.parent.mkdir(parents=True, exist_ok=True)
    bad_json.write_text("[1, 2")
    invalid = platform.submit(input_uri=bad_json.as_uri())
    assert invalid.status_code == 422 and "JSON" in invalid.json()["detail"]


def test_cancel_a_running_job(platform: Platform) -> None:
    running = platform.submit([X] * 16).json()["id"]  # 8 chunks of 2: about 2 s of compute
    platform.wait(running, lambda j: j["status"] == "running" and j["version"] is not None)
    cancelled = platform.client.delete(f"/v1/jobs/{running}")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled"
    quick = platform.submit([X] * 16).json()["id"]
    assert platform.client.delete(f"/v1/jobs/{quick}").json()["status"] == "cancelled"

    # The attempt that was running notices (its lease is gone), stops and writes nothing.
    services.wait_until(
        lambda: any(
            running in line and "lease lost" in line
            for w in platform.workers
            for line in w.log.read_text().splitlines()
        ),
        30,
        "the running attempt to stop",
    )
    job = platform.job(running)
    assert job["status"] == "cancelled" and job["result"] is None and not job["result_uri"]
    assert job["attempts"][-1]["outcome"] in ("cancelled", "superseded"), job["attempts"]
    again = platform.client.delete(f"/v1/jobs/{running}")
    assert again.status_code == 409 and "cancelled" in again.json()["detail"]
    assert platform.job(quick)["status"] == "cancelled"
    assert platform.client.get(f"/v1/jobs/{running}/result").status_code == 409


def test_a_tenant_over_its_quota_gets_429(platform: Platform) -> None:
    """The quota (2000 model units in these tests; uncalibrated, 1 unit per instance)
    covers every unfinished job of the tenant."""
    big = platform.submit([X] * 1500)
    assert big.status_code == 202, big.text
    over = platform.submit([X] * 600)
    assert over.status_code == 429, over.text
    assert int(over.headers["retry-after"]) >= 1
    assert "quota" in over.json()["detail"]
    assert platform.client.delete(f"/v1/jobs/{big.json()['id']}").status_code == 200
    fits = platform.submit([X] * 600)
    assert fits.status_code == 202, fits.text
    assert platform.client.delete(f"/v1/jobs/{fits.json()['id']}").status_code == 200


class Hooks(BaseHTTPRequestHandler):
    received: list[tuple[dict[str, str], bytes]] = []
    fail_first = 1

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        type(self).received.append((dict(self.headers), body))
        failing = len(type(self).received) <= type(self).fail_first
        self.send_response(500 if failing else 204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    Hooks.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hooks)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()
    server.server_close()


def test_webhook_is_signed_and_retried(platform: Platform, receiver: str) -> None:
    secret = platform.client.get("/v1/webhooks/secret").json()
    assert secret["secret"].startswith("whsec_") and secret["header"] == "Ember-Signature"
    job_id = platform.submit([X], webhook_url=receiver).json()["id"]
    job = platform.wait(job_id, lambda j: (j.get("webhook") or {}).get("status") == "delivered")
    assert job["status"] == "succeeded" and job["webhook"]["attempts"] == 2, job["webhook"]
    assert len(Hooks.received) == 2  # the first answered 500: retried with backoff
    headers, body = Hooks.received[-1]
    assert headers["Ember-Job-Id"] == job_id and json.loads(body)["status"] == "succeeded"
    stamp, mac = (part.split("=", 1)[1] for part in headers["Ember-Signature"].split(","))
    expected = hmac.new(secret["secret"].encode(), f"{stamp}.".encode() + body, hashlib.sha256)
    assert hmac.compare_digest(mac, expected.hexdigest())
    assert webhooks.verify(secret["secret"], headers["Ember-Signature"], body)
    assert not webhooks.verify(secret["secret"], headers["Ember-Signature"], body + b" ")
    assert not webhooks.verify("whsec_other", headers["Ember-Signature"], body)


def test_webhooks_never_reach_private_addresses(platform: Platform, tmp_path: Path) -> None:
    for url in (
        "http://127.0.0.1/x",
        "http://localhost:8080/x",
        "http://10.1.2.3/",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/",
        "http://[::ffff:127.0.0.1]/",
        "http://100.64.0.1/",
        "http://0.0.0.0/",
    ):
        with pytest.raises(InvalidInput, match="non-public"):
            webhooks.check_url(url, allow_private=False, must_resolve=False)
    assert webhooks.check_url("http://93.184.215.14/h", allow_private=False, must_resolve=True)

    # Refused at submit by an API that does not allow private addresses...
    strict = Settings(
        data_dir=tmp_path,
        admin_key=ADMIN_KEY,
        pools_enabled=False,  # type: ignore[arg-type]
        redis_url=platform.redis.url,
    )
    with services.serve_app(create_app(strict)) as url:
        response = httpx.post(
            f"{url}/v1/jobs",
            json={"model": MODEL, "inputs": {"instances": [X]}, "webhook_url": "http://127.1/"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
    assert response.status_code == 422 and "non-public" in response.json()["detail"]

    # ... and at delivery, where the address is checked again (a row no worker has been
    # told about, delivered here by a worker whose settings refuse private addresses).
    engine = make_engine(platform.settings.registry_url)
    with records.transaction(engine) as session:
        row = Job(
            uid=records.new_uid(),
            tenant_id=1,
            model=MODEL,
            deployment=MODEL,
            status="succeeded",
            request_sha256="0" * 64,
            webhook_url="http://127.0.0.1:9/never",
            webhook_status="pending",
            webhook_next_at=records.utcnow(),
        )
        session.add(row)
    no_private = platform.settings.model_copy(update={"jobs_webhook_allow_private": False})
    publisher = Publisher(no_private)
    outcome = webhooks.deliver(engine, no_private, publisher, row.uid, job_document)
    publisher.close()
    assert outcome == "refused"
    assert "non-public" in platform.job(row.uid)["webhook"]["error"]


def test_results_are_purged_after_their_ttl(platform: Platform) -> None:
    job = platform.wait(platform.submit([X, Y, X, Y]).json()["id"])
    assert job["status"] == "succeeded" and job["result_uri"], job
    folder = Path(job["result_uri"].removeprefix("file://")).parent
    assert folder.is_dir()
    engine = make_engine(platform.settings.registry_url)
    sweeper = Sweeper(platform.settings, engine, Publisher(platform.settings))
    with Session(engine) as session:
        finished = session.exec(select(Job).where(Job.uid == job["id"])).one().finished_at
    assert finished is not None
    soon = finished + timedelta(seconds=platform.settings.jobs_result_ttl_s - 60)
    assert job["id"] not in sweeper.purge(soon)  # not yet
    later = finished + timedelta(seconds=platform.settings.jobs_result_ttl_s + 1)
    assert job["id"] in sweeper.purge(later)
    assert not folder.exists()
    purged = platform.job(job["id"])
    assert purged["result_purged"] and purged["status"] == "succeeded"
    gone = platform.client.get(f"/v1/jobs/{job['id']}/result")
    assert gone.status_code == 404 and "purged" in gone.json()["detail"]
