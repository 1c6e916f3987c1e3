"""The parts a worker's shards share: the input cache (one read per file), the window
(first-started shards first), the lean gateway client (a keep-alive connection the
server closed is retried on a fresh one) and the direct lane (replicas it cannot reach
left out, the gateway behind it). No platform needed."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.batch import datasets, plan
from ember.batch.client import InputCache, Lane
from ember.batch.schemas import BatchSpec
from ember.batch.shards import ShardRunner, Window
from ember.config import Settings
from ember.errors import ObjectChanged
from ember.loader.stores import ObjectInfo
from ember.registry.tables import BatchRun
from ember.web.tensorbody import TensorBody
from ember.work.client import GatewayClient
from ember.work.failures import Transient
from ember.work.lease import Lease

PROBLEM = "application/problem+json"


def test_the_input_cache_reads_a_file_once_and_lets_go_of_it() -> None:
    reads: list[str] = []

    def read(info: ObjectInfo) -> bytes:
        reads.append(info.uri)
        time.sleep(0.05)
        return b"x" * info.size

    cache = InputCache(max_bytes=100, idle_s=0.2)
    a = ObjectInfo("file:///a", 60, "1")
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: cache.get(a, read), range(4)))
    assert reads == ["file:///a"] and all(g[0] == got[0][0] and g[1] is got[0][1] for g in got)
    assert got[0][1].get("n", lambda: 7) == 7 and got[0][1].get("n", lambda: 8) == 7
    cache.get(ObjectInfo("file:///a", 60, "2"), read)  # a new ETag is a new object
    assert reads == ["file:///a"] * 2 and len(cache.entries) == 1  # within 100 bytes
    cache.get(ObjectInfo("file:///big", 101, "1"), read)  # too big to keep
    assert len(cache.entries) == 1
    time.sleep(0.3)
    cache.trim()
    assert not cache.entries


def test_the_window_serves_the_first_started_shard_first() -> None:
    window = Window(1)
    first, second = window.ticket(), window.ticket()
    assert window.acquire(second, timeout=0.1)  # nobody earlier is waiting
    order: list[int] = []

    def take(ticket: int) -> None:
        assert window.acquire(ticket, timeout=5)
        order.append(ticket)
        window.release()

    late = threading.Thread(target=take, args=(second,))
    late.start()
    time.sleep(0.05)
    early = threading.Thread(target=take, args=(first,))
    early.start()
    time.sleep(0.05)
    assert window.yields(second)  # an earlier shard waits: give the slot back
    window.release()
    late.join(5)
    early.join(5)
    assert order == [first, second]
    window.resize("128", 64)
    assert window.size == 2
    for bad in (None, "", "-1", "many", "²"):
        window.resize(bad, 64)
        assert window.size == 2
    window.resize("10", 64)  # less than one batch: still one
    assert window.size == 1


class Closing(BaseHTTPRequestHandler):
    """Answers, then closes the connection without saying so (a keep-alive timer)."""

    protocol_version = "HTTP/1.1"
    served: list[bytes] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.served.append(body)
        answer = b'{"ok": true}'
        self.send_response(200)
        self.send_header("content-length", str(len(answer)))
        self.send_header("x-seen", self.headers.get("x-test", ""))
        self.end_headers()
        self.wfile.write(answer)
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


def test_the_gateway_client_retries_a_connection_closed_while_idle() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Closing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = GatewayClient(f"http://127.0.0.1:{server.server_port}", {"x-test": "yes"})
        for n in range(3):
            reply = client.post("/p", f"body{n}".encode(), {"content-type": "text/plain"})
            assert reply.status_code == 200 and reply.content == b'{"ok": true}'
            assert reply.headers["x-seen"] == "yes"
            time.sleep(0.05)  # the server has closed its end by now
        assert Closing.served == [b"body0", b"body1", b"body2"]
        client.close()
    finally:
        server.shutdown()
        server.server_close()


class Scripted(BaseHTTPRequestHandler):
    """A gateway and replicas in one: ``routes[path]`` is ``(status, headers, body)``;
    every request is kept as ``(path, body)``."""

    protocol_version = "HTTP/1.1"
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
    seen: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.seen.append((self.path, body))
        status, headers, answer = self.routes[self.path]
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_direct_lane_leaves_out_what_it_cannot_reach_and_falls_back_to_the_gateway() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    dead = f"http://127.0.0.1:{closed_port()}"
    predictions = np.arange(8, dtype=np.float64).reshape(4, 2)
    tensor = TensorBody.of(predictions)

    def lane_answer(*replicas: tuple[str, str]) -> tuple[int, dict[str, str], bytes]:
        doc = {"replicas": [{"id": i, "url": u, "window": 128} for i, u in replicas],
               "refresh_s": 30}  # fmt: skip
        return 200, {"content-type": "application/json"}, json.dumps(doc).encode()

    json_answer = json.dumps({"predictions": predictions.tolist(), "version": "1", "model": "m"})
    Scripted.routes = {
        "/v1/models/m/versions/1:batch-lane": lane_answer(("dead", dead), ("live", base)),
        "/v1/models/m/versions/1:predict": (200, {}, json_answer.encode()),
        "/infer": (200, {"content-type": tensor.content_type, "x-ember-version": "1"},
                   tensor.data),
    }  # fmt: skip
    Scripted.seen = []
    settings = Settings(jobs_api_url=base, jobs_api_key="ek_test-key-0123456789")  # type: ignore[arg-type]
    runner = ShardRunner(settings, None, None)  # type: ignore[arg-type]
    run = BatchRun(uid="br_1", model="m", version="1")
    chunk = np.zeros((4, 3), np.float32)

    def call(lane: Lane | None) -> Any:
        lease = Lease(1, "t")
        return runner._call(run, "acme", chunk, lease, threading.Event(), Window(), 4, lane)

    try:
        lane = runner._lane("acme", run)
        assert lane is not None
        lane.refresh()
        assert [t.replica_id for t in lane.targets] == ["dead", "live"]
        got = call(lane)  # the dead one refuses the connection: left out, the live one answers
        assert isinstance(got, np.ndarray) and np.array_equal(got, predictions)
        assert [t.replica_id for t in lane.targets] == ["live"] and lane.sent == 4
        paths = [p for p, _ in Scripted.seen]
        assert paths == ["/v1/models/m/versions/1:batch-lane", "/infer"]
        assert Scripted.seen[1][1] == TensorBody.of(chunk).data

        # a replica that is not serving (503) is left out too; with none left, :predict
        Scripted.routes["/infer"] = (503, {"content-type": PROBLEM}, b"{}")
        assert call(lane) == predictions.tolist() and not lane.direct
        assert [p for p, _ in Scripted.seen][-2:] == ["/infer", "/v1/models/m/versions/1:predict"]

        # a replica of another version is never taken for this one
        Scripted.routes["/infer"] = (200, {"content-type": tensor.content_type,
                                           "x-ember-version": "2"}, tensor.data)  # fmt: skip
        lane.expires = 0.0  # the next call asks the gateway again, reporting what it sent
        with pytest.raises(Transient, match="version '2'"):
            call(lane)
        report = next(b for p, b in reversed(Scripted.seen) if p.endswith(":batch-lane"))
        assert json.loads(report) == {"sent": 4}

        # EMBER_BATCH_DIRECT=false: no lane at all
        off = ShardRunner(Settings(jobs_api_url=base, batch_direct=False), None, None)  # type: ignore[arg-type]
        assert off._lane("acme", run) is None
        off.close()
    finally:
        runner.close()
        server.shutdown()
        server.server_close()


def test_a_jsonl_shard_reads_its_own_bytes_and_refuses_a_changed_input(tmp_path: Path) -> None:
    """Planning gives each JSONL shard its byte range and the input's etag; the worker
    reads just those bytes and gets what reading the whole file gives (the same rows,
    rejects numbered in the file); an input changed since planning is refused."""
    rows: list[Any] = [
        {"id": i, "features": [0.5, 1.0, float(i), -2.0]} for i in range(23)
    ]  # fmt: skip
    rows[4] = {"id": 4, "features": [1.0]}  # wrong length: a reject
    rows[17] = "{not json"
    path = tmp_path / "in.jsonl"
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n\n" for r in rows)
    path.write_text(text)
    settings = Settings(data_dir=tmp_path / "data", file_roots=[tmp_path])  # type: ignore[call-arg]
    spec = BatchSpec(model="m", input_uri=path.as_uri(), output_uri=(tmp_path / "o").as_uri(),
                     shard_rows=10)  # fmt: skip
    schema = {"shape": [4], "dtype": "float32"}
    shards = plan.plan_shards(settings, spec, path.as_uri())
    assert [(s.row_start, s.row_end) for s in shards] == [(0, 10), (10, 20), (20, 23)]
    assert all(s.input_etag and s.byte_start is not None for s in shards)
    assert shards[0].byte_start == 0 and shards[-1].byte_end == len(text) - 2  # blank lines out
    runner = ShardRunner(settings, None, None)  # type: ignore[arg-type]
    data = path.read_bytes()
    try:
        for shard in shards:
            ranged = runner._read(shard, "jsonl", spec, schema)
            whole = datasets.read_shard(data, "jsonl", path.as_uri(), shard.row_start,
                                        shard.row_end, ["id"], "features", schema)  # fmt: skip
            assert ranged.total == whole.total and ranged.rejects == whole.rejects
            assert ranged.keys["id"].to_pylist() == whole.keys["id"].to_pylist()
            assert np.array_equal(ranged.instances, whole.instances)
        assert [
            r["row"] for s in shards for r in runner._read(s, "jsonl", spec, schema).rejects
        ] == [
            4,
            17,
        ]
        path.write_text(text.replace('"id": 12,', '"id": 99,'))  # same length, new bytes
        with pytest.raises(ObjectChanged):
            runner._read(shards[1], "jsonl", spec, schema)
        whole_file = shards[1].model_copy(update={"byte_start": None, "byte_end": None})
        with pytest.raises(ObjectChanged):  # a shard read whole checks the etag too
            runner._read(whole_file, "jsonl", spec, schema)
    finally:
        runner.close()


def test_a_lane_takes_only_what_it_can_use_from_the_gateway() -> None:
    lane = Lane(GatewayClient("http://127.0.0.1:1", {}), "acme", "m", "1")
    lane._adopt(
        [
            {"id": "ftp", "url": "ftp://127.0.0.1/x", "window": 64},
            {"id": "nowin", "url": "http://127.0.0.1:2", "window": "many"},
            {"url": "http://127.0.0.1:3", "window": 64},
            {"id": "ok", "url": "http://127.0.0.1:4", "window": 0},
        ]
    )
    assert [(t.replica_id, t.window) for t in lane.targets] == [("ok", 1)]
    first = lane.take()
    assert first is not None and first.inflight == 1 and lane.window() == 1
    lane._adopt([{"id": "ok", "url": "http://127.0.0.1:4", "window": 128}])
    assert lane.targets == [first] and first.window == 128  # the same target, in flight
    lane.done(first, 64, ok=True)
    assert first.inflight == 0 and lane.sent == 64
    lane._adopt([{"id": "new", "url": "http://127.0.0.1:5", "window": 128}])
    assert list(lane.clients) == ["http://127.0.0.1:5"]  # the gone replica's client closed
    lane.close()
