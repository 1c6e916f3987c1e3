"""Loader fixtures: artifacts, S3 settings against the suite's moto server, a faulty proxy."""

from __future__ import annotations

import http.client
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import boto3
import pytest

from ember.config import Settings

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402


def make_state_dict(seed: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    """A small realistic mix: bf16/fp16/fp32, odd sizes (misaligned neighbours), a scalar."""
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for i in range(24):
        dtype = (torch.bfloat16, torch.float16, torch.float32)[i % 3]
        rows = (17 + 31 * i) * scale
        sd[f"layers.{i}.weight"] = torch.randn(rows, 64, generator=gen).to(dtype)
        sd[f"layers.{i}.bias"] = torch.randn(rows + (i % 2), generator=gen).to(dtype)
    sd["scalar"] = torch.tensor(1.5)
    sd["empty"] = torch.empty(0, 3)
    return sd


def write_artifact(path: Path, seed: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    sd = make_state_dict(seed, scale)
    save_file(sd, str(path))
    return sd


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        t = got[name]
        assert t.dtype == ref.dtype and t.shape == ref.shape, name
        assert torch.equal(t.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8))


@dataclass
class FaultyProxy:
    """A real HTTP proxy in front of moto that can answer 503/500, cut bodies short and
    count GETs — the faults a real S3 shows, on demand."""

    upstream: str
    url: str = ""
    faults: list[str] = field(default_factory=list)
    """Consumed one per ranged GET: ``"503"``, ``"500"``, ``"cut"`` (half a body)."""
    delay_s: float = 0.0
    gets: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_fault(self, method: str, has_range: bool) -> str | None:
        with self.lock:
            if method == "GET" and has_range:
                self.gets += 1
                if self.faults:
                    return self.faults.pop(0)
        return None


def _handler(proxy: FaultyProxy) -> type[BaseHTTPRequestHandler]:
    up = urlparse(proxy.upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            fault = proxy.next_fault(self.command, "Range" in self.headers)
            if fault in ("503", "500"):
                code, err = (503, "SlowDown") if fault == "503" else (500, "InternalError")
                xml = f"<Error><Code>{err}</Code><Message>injected</Message></Error>".encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(xml)))
                self.end_headers()
                self.wfile.write(xml)
                return
            if proxy.delay_s:
                time.sleep(proxy.delay_s)
            conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self.send_response(resp.status)
            head = self.command == "HEAD"
            for k, v in resp.getheaders():
                skip = ("connection", "transfer-encoding") + (() if head else ("content-length",))
                if k.lower() not in skip:
                    self.send_header(k, v)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            if fault == "cut":
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.end_headers()
            self.wfile.write(data)
            conn.close()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

    return Handler


@pytest.fixture
def faulty_proxy(moto_endpoint: str) -> Iterator[FaultyProxy]:
    proxy = FaultyProxy(moto_endpoint)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(proxy))
    server.daemon_threads = True
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def s3_settings(data_dir: Path, endpoint: str, **extra: object) -> Settings:
    return Settings(
        data_dir=data_dir,
        s3_endpoint_url=endpoint,
        s3_allowed_buckets=["*"],
        s3_part_size_bytes=5 * 1024 * 1024,
        s3_retry_base_s=0.01,
        s3_retry_max_backoff_s=0.05,
        **extra,  # type: ignore[arg-type]
    )


@pytest.fixture
def bucket(moto_endpoint: str) -> str:
    name = f"ember-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=name
    )
    return name


def upload(endpoint: str, bucket: str, key: str, path: Path) -> str:
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").upload_file(
        str(path), bucket, key
    )
    return f"s3://{bucket}/{key}"
