"""The one HTTP client a worker calls the data plane with (the gateway, or a replica).

**Why ``http.client`` and not httpx.** A batch worker sends one request per
``max_batch_size`` rows, so the client's CPU per request is spent thousands of times a
run on the same cores as the model: httpx costs several times what ``http.client`` does
per request (measured: ~0.9 ms vs ~0.25 ms for a 64 KiB body), and the batch lanes rely
on its thread-local keep-alive connections. Jobs send fewer, larger requests and need
nothing httpx has that this lacks (a per-call timeout is ``post(timeout_s=)``), so both
use this one.

Keep-alive HTTP/1.1, one connection per thread. A connection the server closed while
idle (its keep-alive timer won the race) is retried once on a fresh one; predict is
idempotent. ``post`` raises ``OSError`` (``TimeoutError`` on a timeout) or
``http.client.HTTPException`` when the server cannot be reached or drops the connection.

``api_url`` is where a worker finds the gateway, ``worker_id`` how it names itself in
the attempts it records.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ember.config import Settings


def api_url(settings: Settings) -> str:
    """``EMBER_JOBS_API_URL``, else this host's API (``EMBER_HOST``/``EMBER_PORT``)."""
    if settings.jobs_api_url:
        return settings.jobs_api_url.rstrip("/")
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{settings.port}"


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True, slots=True)
class Reply:
    status_code: int
    headers: dict[str, str]
    """Lower-case names."""
    content: bytes
    reason: str = ""

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON (``ValueError`` when it is not)."""
        return json.loads(self.content)

    def problem(self) -> tuple[str, str]:
        """An error answer's ``(detail, code)``: an RFC 9457 body's detail and type's last
        segment, else its text and ``http-<status>``."""
        try:
            doc = self.json()
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            code = str(doc.get("type", "")).rsplit("/", 1)[-1] or f"http-{self.status_code}"
            return str(doc.get("detail") or doc.get("title") or self.reason)[:1500], code
        return (self.text[:500] or self.reason), f"http-{self.status_code}"


class GatewayClient:
    def __init__(self, base_url: str, headers: dict[str, str], timeout_s: float = 130.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the gateway URL must be http(s)://host[:port], got {base_url!r}")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.headers = headers
        self.timeout_s = timeout_s
        self.local = threading.local()
        self.lock = threading.Lock()
        self.open: set[http.client.HTTPConnection] = set()

    def post(
        self, path: str, body: bytes, headers: dict[str, str], timeout_s: float | None = None
    ) -> Reply:
        """POST and read the whole answer. ``timeout_s``: this call's socket timeout
        (connect, and each read or write), else the client's."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        for attempt in (0, 1):
            conn: http.client.HTTPConnection | None = getattr(self.local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = self._connect()
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            try:
                conn.request("POST", self.prefix + path, body=body, headers=self.headers | headers)
                response = conn.getresponse()
                content = response.read()
            except TimeoutError:
                self._drop(conn)
                raise
            except (OSError, http.client.HTTPException):
                self._drop(conn)
                if reused and attempt == 0:
                    continue
                raise
            if response.will_close:
                self._drop(conn)
            else:
                self.local.conn = conn
            names = {k.lower(): v for k, v in response.getheaders()}
            return Reply(response.status, names, content, response.reason)
        raise AssertionError("unreachable")

    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = kind(self.host, self.port, timeout=self.timeout_s)
        with self.lock:
            self.open.add(conn)
        return conn

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        self.local.conn = None
        with self.lock:
            self.open.discard(conn)

    def close(self) -> None:
        with self.lock:
            conns, self.open = self.open, set()
        for conn in conns:
            conn.close()
