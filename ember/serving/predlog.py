"""The prediction log: one record per prediction, written off the latency path.

``PredictionLog.record`` only appends a dict to a bounded in-memory backlog (no I/O, no
serialisation); a writer thread serialises and flushes it every ``window_s`` (and sooner
when the backlog fills up) to a sink:

- ``FileSink``: JSONL under a directory, one file per hour
  (``predictions-YYYYMMDD-HH[.N].jsonl``, UTC), rolled over at a size limit as well;
- ``S3Sink``: one object per flush window,
  ``<prefix>/YYYY/MM/DD/HH/<window start>-<host>-<pid>-<seq>.jsonl``.

A sink that fails keeps its records in the backlog and is retried on the next flush;
when the backlog is full, new records are dropped and counted — the request that
produced them is never failed or slowed down by the log.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlparse

from ember.logs import get_logger
from ember.serving.cache import digest

if TYPE_CHECKING:
    from ember.config import Settings

log = get_logger(__name__)
DEFERRED_DIGESTS = "_digest"
"""A record may carry ``{field: value}`` under this key: the writer stores
``field = sha256(value)`` — of the bytes themselves when ``value`` is the answer's JSON
bytes, else of its canonical JSON — so hashing stays off the request's path."""


class Sink(Protocol):
    def write(self, lines: list[bytes], window_start: float) -> None:
        """Persist the lines or raise; a raise keeps them for the next try."""

    def describe(self) -> str: ...


class FileSink:
    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._hour = ""
        self._part = 0

    def describe(self) -> str:
        return self.directory.as_uri()

    def _path(self, hour: str) -> Path:
        suffix = f".{self._part}" if self._part else ""
        return self.directory / f"predictions-{hour}{suffix}.jsonl"

    def write(self, lines: list[bytes], window_start: float) -> None:
        hour = datetime.now(UTC).strftime("%Y%m%d-%H")
        if hour != self._hour:
            self._hour, self._part = hour, 0
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(hour)
        while path.exists() and path.stat().st_size >= self.max_bytes:
            self._part += 1
            path = self._path(hour)
        with path.open("ab") as f:
            f.write(b"".join(lines))
            f.flush()


class S3Sink:
    def __init__(self, url: str, settings: Settings) -> None:
        from ember.loader.stores import S3Store

        parsed = urlparse(url)
        self.bucket, self.prefix = parsed.netloc, parsed.path.strip("/")
        self.store = S3Store(settings, {self.bucket})
        self.host = socket.gethostname()
        self._seq = 0

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def write(self, lines: list[bytes], window_start: float) -> None:
        self._seq += 1
        at = datetime.fromtimestamp(window_start, UTC)
        name = f"{at:%Y/%m/%d/%H}/{at:%Y%m%dT%H%M%SZ}-{self.host}-{os.getpid()}-{self._seq:06d}"
        key = f"{self.prefix}/{name}.jsonl" if self.prefix else f"{name}.jsonl"
        self.store.client.put_object(
            Bucket=self.bucket, Key=key, Body=b"".join(lines), ContentType="application/x-ndjson"
        )


def open_sink(url: str, settings: Settings) -> Sink | None:
    if url == "off":
        return None
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        return S3Sink(url, settings)
    return FileSink(Path(parsed.path), settings.prediction_log_file_bytes)


def _digest(value: Any) -> str:
    """sha256 of ``value``'s bytes as they were answered, or of its canonical JSON."""
    if isinstance(value, bytes):
        return hashlib.sha256(value).hexdigest()
    return digest(value)


class PredictionLog:
    def __init__(self, sink: Sink | None, *, backlog: int = 100_000, window_s: float = 60.0):
        self.sink = sink
        self.backlog = backlog
        # Files are cheap to append to: flush them every second; S3 gets one object a window.
        self.window_s = min(window_s, 1.0) if isinstance(sink, FileSink) else window_s
        self.records: deque[dict[str, Any]] = deque()
        self.retry: list[bytes] = []
        self.written = 0
        self.dropped = 0
        self.sink_errors = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if sink is not None:
            self._thread = threading.Thread(target=self._run, name="prediction-log", daemon=True)
            self._thread.start()

    @classmethod
    def from_settings(cls, settings: Settings) -> PredictionLog:
        sink = open_sink(settings.prediction_log_target, settings)
        if sink is not None:
            log.info("prediction log", sink=sink.describe())
        return cls(
            sink, backlog=settings.prediction_log_backlog, window_s=settings.prediction_log_window_s
        )

    @property
    def pending(self) -> int:
        return len(self.records) + len(self.retry)

    def record(self, record: dict[str, Any]) -> None:
        """Queue one record; never blocks, never raises."""
        if self.sink is None:
            return
        if self.pending >= self.backlog:
            self.dropped += 1
            return
        self.records.append(record)
        if len(self.records) >= self.backlog // 2:
            self._wake.set()

    def flush(self) -> bool:
        """Write what is queued now; False if the sink failed (the records are kept)."""
        if self.sink is None:
            return True
        with self._lock:
            window_start = time.time()
            lines = self.retry
            self.retry = []
            while self.records:
                record = self.records.popleft()
                for field, value in record.pop(DEFERRED_DIGESTS, {}).items():
                    record[field] = _digest(value)
                line = json.dumps(record, separators=(",", ":"), default=str)
                lines.append(line.encode() + b"\n")
            if not lines:
                return True
            try:
                self.sink.write(lines, window_start)
            except Exception as exc:  # the sink is down: keep the lines, retry next window
                self.sink_errors += 1
                keep = max(0, self.backlog - len(self.records))
                self.dropped += max(0, len(lines) - keep)
                self.retry = lines[-keep:] if keep else []
                log.warning(
                    "prediction log sink failed",
                    sink=self.sink.describe(),
                    error=f"{type(exc).__name__}: {exc}",
                    kept=len(self.retry),
                )
                return False
            self.written += len(lines)
            return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.window_s)
            self._wake.clear()
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.flush()
