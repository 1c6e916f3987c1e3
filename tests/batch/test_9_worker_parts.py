"""The parts a worker's shards share: the input cache (one read per file), the window
(first-started shards first) and the lean gateway client (a keep-alive connection the
server closed is retried on a fresh one). No platform needed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ember.batch.client import GatewayClient, InputCache
from ember.batch.shards import Window
from ember.loader.stores import ObjectInfo


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
