"""Object stores behind one small interface: ``file://`` and ``s3://``.

``open_store(uri, settings)`` checks that the URI is allowed (file roots, bucket allowlist)
before anything is read, so an artifact URI can never escape the configured locations —
not with ``..``, not through a symlink. botocore errors are translated to Ember's
``LoaderError`` family here and nowhere else.

Reads are made for weights: ``iter_parts`` keeps ``concurrency`` ranged reads in flight
and yields the parts in order, every S3 request is retried on throttling, 5xx and broken
connections with capped exponential backoff and full jitter, and every part is read with
``If-Match`` on the ETag taken at ``stat`` time (plus a size check), so bytes of a changed
object are never mixed with bytes of the old one.
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import unquote, urlparse

from ember.config import Settings
from ember.errors import (
    LoaderError,
    ObjectChanged,
    ObjectNotFound,
    StoreAccessDenied,
    StoreUnavailable,
)
from ember.logs import get_logger, submit_in_context

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

Progress = Callable[[int], None]
T = TypeVar("T")
log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    uri: str
    size: int
    etag: str
    """Changes whenever the object's bytes may have changed."""


class ObjectStore(ABC):
    """Read (and write) whole objects and byte ranges of one store."""

    @abstractmethod
    def stat(self, uri: str) -> ObjectInfo: ...

    @abstractmethod
    def read_range(self, uri: str, start: int, length: int, *, etag: str | None = None) -> bytes:
        """Exactly ``length`` bytes from ``start``; ``ObjectChanged`` if the etag moved."""

    @abstractmethod
    def put_file(self, path: Path, uri: str, progress: Progress | None = None) -> ObjectInfo: ...

    #: Parallel reads ``iter_parts`` keeps in flight by default (stores override).
    default_concurrency: int = 1
    default_part_bytes: int = 8 * 1024 * 1024

    def iter_parts(
        self,
        uri: str,
        info: ObjectInfo,
        *,
        start: int = 0,
        part_bytes: int | None = None,
        concurrency: int | None = None,
    ) -> Iterator[tuple[int, bytes]]:
        """``(offset, bytes)`` of ``[start, info.size)`` in order, ``concurrency`` reads in
        flight (at most ``concurrency + 1`` parts held in memory).

        Every part is read against ``info.etag``: if the object changes midway the read
        fails with ``ObjectChanged`` instead of mixing old and new bytes.
        """
        part = part_bytes or self.default_part_bytes
        workers = concurrency or self.default_concurrency
        offsets = iter(range(start, info.size, part))
        if workers <= 1:
            for off in offsets:
                yield off, self.read_range(uri, off, min(part, info.size - off), etag=info.etag)
            return
        inflight: deque[tuple[int, Future[bytes]]] = deque()
        with ThreadPoolExecutor(workers, thread_name_prefix="ember-get") as pool:
            try:
                for off in offsets:
                    n = min(part, info.size - off)
                    fut = submit_in_context(pool, self.read_range, uri, off, n, etag=info.etag)
                    inflight.append((off, fut))
                    if len(inflight) >= workers:
                        done_off, done = inflight.popleft()
                        yield done_off, done.result()
                while inflight:
                    done_off, done = inflight.popleft()
                    yield done_off, done.result()
            finally:
                # A consumer that stops early (error, generator closed) must not leave
                # requests running: cancel what has not started, let the rest finish.
                for _, fut in inflight:
                    fut.cancel()

    def iter_chunks(
        self, uri: str, chunk_bytes: int = 8 * 1024 * 1024, *, etag: str | None = None
    ) -> Iterator[bytes]:
        info = self.stat(uri)
        if etag is not None and info.etag != etag:
            raise ObjectChanged(f"{uri} changed (etag {info.etag} != {etag})")
        for _, chunk in self.iter_parts(uri, info, part_bytes=chunk_bytes):
            yield chunk

    def sha256(self, uri: str, progress: Progress | None = None) -> tuple[str, ObjectInfo]:
        """Digest of the whole object, read in parallel parts (never whole in memory)."""
        info = self.stat(uri)
        digest = hashlib.sha256()
        for _, chunk in self.iter_parts(uri, info):
            digest.update(chunk)
            if progress:
                progress(len(chunk))
        return digest.hexdigest(), info


class FileStore(ObjectStore):
    """Local files confined to ``roots`` (realpath-checked, so symlinks cannot escape)."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = [Path(os.path.realpath(r)) for r in roots]

    def path_of(self, uri: str) -> Path:
        parsed = urlparse(uri)
        if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
            raise StoreAccessDenied(f"{uri!r} is not a local file:// URI")
        raw = unquote(parsed.path)
        if "\x00" in raw or not raw.startswith("/"):
            raise StoreAccessDenied(f"{uri!r} is not an absolute file path")
        real = Path(os.path.realpath(raw))
        if not any(real == root or root in real.parents for root in self.roots):
            allowed = ", ".join(str(r) for r in self.roots) or "(none)"
            raise StoreAccessDenied(
                f"{uri!r} resolves outside the allowed file roots ({allowed})",
                allowed_roots=[str(r) for r in self.roots],
            )
        return real

    def stat(self, uri: str) -> ObjectInfo:
        path = self.path_of(uri)
        try:
            st = path.stat()
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no object at {uri}") from exc
        except OSError as exc:
            raise StoreUnavailable(f"cannot stat {uri}: {exc.strerror}") from exc
        if not path.is_file():
            raise ObjectNotFound(f"{uri} is not a regular file")
        return ObjectInfo(uri, st.st_size, f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}")

    def read_range(self, uri: str, start: int, length: int, *, etag: str | None = None) -> bytes:
        path = self.path_of(uri)
        try:
            with path.open("rb") as fh:
                if etag is not None and self._etag(os.fstat(fh.fileno())) != etag:
                    raise ObjectChanged(f"{uri} changed while it was read")
                data = os.pread(fh.fileno(), length, start)
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no object at {uri}") from exc
        if len(data) != length:
            raise ObjectChanged(f"{uri}: short read at {start} ({len(data)} of {length} bytes)")
        return data

    @staticmethod
    def _etag(st: os.stat_result) -> str:
        return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"

    def put_file(self, path: Path, uri: str, progress: Progress | None = None) -> ObjectInfo:
        dest = self.path_of(uri)
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Write beside the target and rename: a reader never sees a half-written artifact.
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, path.open("rb") as src:
                while chunk := src.read(8 * 1024 * 1024):
                    out.write(chunk)
                    if progress:
                        progress(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self.stat(uri)


class S3Store(ObjectStore):
    """S3 or an S3-compatible endpoint, limited to ``allowed_buckets`` (``*`` = any).

    Reads (``stat``, ``read_range``) use a client without botocore's own retries and retry
    here instead, because a failure while the body streams (reset, short read) is not a
    request botocore would retry; uploads keep botocore's standard retry mode.
    """

    def __init__(self, settings: Settings, allowed_buckets: set[str]) -> None:
        self.settings = settings
        self.allowed_buckets = allowed_buckets
        self.default_concurrency = settings.s3_max_concurrency
        self.default_part_bytes = settings.s3_part_size_bytes
        self._client: S3Client | None = None
        self._read_client: S3Client | None = None
        self.retry = RetryPolicy(
            settings.s3_max_attempts, settings.s3_retry_base_s, settings.s3_retry_max_backoff_s
        )

    def _make_client(self, retries: dict[str, Any]) -> S3Client:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.settings.s3_endpoint_url,
            region_name=self.settings.s3_region,
            config=Config(
                retries=retries,  # type: ignore[arg-type]
                max_pool_connections=max(10, self.settings.s3_max_concurrency * 2),
                connect_timeout=10,
                read_timeout=60,
            ),
        )

    @property
    def client(self) -> S3Client:
        if self._client is None:
            self._client = self._make_client(
                {"max_attempts": self.settings.s3_max_attempts, "mode": "standard"}
            )
        return self._client

    @property
    def read_client(self) -> S3Client:
        if self._read_client is None:
            self._read_client = self._make_client({"total_max_attempts": 1, "mode": "standard"})
        return self._read_client

    def split(self, uri: str) -> tuple[str, str]:
        parsed = urlparse(uri)
        bucket, key = parsed.netloc, parsed.path.lstrip("/")
        if parsed.scheme != "s3" or not bucket or not key:
            raise StoreAccessDenied(f"{uri!r} is not an s3://bucket/key URI")
        if "*" not in self.allowed_buckets and bucket not in self.allowed_buckets:
            allowed = ", ".join(sorted(self.allowed_buckets)) or "(none)"
            raise StoreAccessDenied(
                f"bucket {bucket!r} is not allowed (allowed: {allowed}); "
                "set EMBER_S3_ALLOWED_BUCKETS",
                allowed_buckets=sorted(self.allowed_buckets),
            )
        return bucket, key

    def stat(self, uri: str) -> ObjectInfo:
        bucket, key = self.split(uri)

        def head() -> ObjectInfo:
            with translate_s3_errors(uri):
                resp = self.read_client.head_object(Bucket=bucket, Key=key)
            return ObjectInfo(uri, int(resp["ContentLength"]), str(resp["ETag"]))

        return self.retry.call(head, what=f"HEAD {uri}")

    def read_range(self, uri: str, start: int, length: int, *, etag: str | None = None) -> bytes:
        bucket, key = self.split(uri)
        if length == 0:
            return b""
        extra: dict[str, Any] = {"IfMatch": etag} if etag else {}
        end = start + length - 1

        def get() -> bytes:
            with translate_s3_errors(uri):
                resp = self.read_client.get_object(
                    Bucket=bucket, Key=key, Range=f"bytes={start}-{end}", **extra
                )
                data = resp["Body"].read()
            if len(data) != length:
                # A short body is a broken transfer, not a smaller object: retry it.
                raise StoreUnavailable(
                    f"{uri}: short read at {start} ({len(data)} of {length} bytes)"
                )
            return data

        return self.retry.call(get, what=f"GET {uri} bytes={start}-{end}")

    def put_file(self, path: Path, uri: str, progress: Progress | None = None) -> ObjectInfo:
        from boto3.s3.transfer import TransferConfig

        bucket, key = self.split(uri)
        part = self.settings.s3_part_size_bytes
        config = TransferConfig(
            multipart_threshold=part,
            multipart_chunksize=part,
            max_concurrency=self.settings.s3_max_concurrency,
        )
        with translate_s3_errors(uri):
            self.client.upload_file(str(path), bucket, key, Config=config, Callback=progress)
        return self.stat(uri)


class Retryable(StoreUnavailable):
    """Throttling, a 5xx or a broken connection: worth another attempt after a backoff."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Capped exponential backoff with full jitter (sleep ~ U(0, min(cap, base * 2**n)))."""

    max_attempts: int
    base_s: float
    max_backoff_s: float

    def backoff_s(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.max_backoff_s, self.base_s * 2**attempt))

    def call(self, fn: Callable[[], T], *, what: str) -> T:
        for attempt in range(self.max_attempts):
            try:
                return fn()
            except Retryable as exc:
                if attempt + 1 >= self.max_attempts:
                    raise StoreUnavailable(
                        f"{what}: gave up after {self.max_attempts} attempts: {exc.detail}",
                        attempts=self.max_attempts,
                    ) from exc
                delay = self.backoff_s(attempt)
                log.warning(
                    "store request failed, retrying",
                    request=what, attempt=attempt + 1, delay_s=round(delay, 3), error=exc.detail,
                )  # fmt: skip
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover


#: S3 error codes that mean "slow down" or "try again", whatever the HTTP status.
_RETRY_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "TooManyRequests",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "RequestLimitExceeded", "BandwidthLimitExceeded", "EC2ThrottledException",
})  # fmt: skip


class translate_s3_errors:
    """Map botocore exceptions to Ember's loader errors (the one seam where that happens)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is None:
            return False
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound") or status == 404:
                raise ObjectNotFound(f"no object at {self.uri}") from exc
            if code == "PreconditionFailed" or status == 412:
                raise ObjectChanged(f"{self.uri} changed while it was read") from exc
            if code in ("AccessDenied", "403", "Forbidden") or status == 403:
                raise StoreAccessDenied(f"access to {self.uri} denied by the store") from exc
            if code in _RETRY_CODES or status == 429 or status >= 500:
                raise Retryable(f"S3 error on {self.uri}: {code or status}") from exc
            raise StoreUnavailable(f"S3 error on {self.uri}: {code or status}") from exc
        if isinstance(exc, BotoCoreError):
            # Connection refused/reset, timeouts, a body cut short: all transient.
            raise Retryable(f"S3 unreachable for {self.uri}: {exc}") from exc
        if isinstance(exc, OSError) and not isinstance(exc, LoaderError):
            raise Retryable(f"S3 connection broke for {self.uri}: {exc}") from exc
        return False


def open_store(uri: str, settings: Settings) -> ObjectStore:
    """The store for ``uri``, with the access limits from ``settings``."""
    scheme = urlparse(uri).scheme
    if scheme == "file":
        return FileStore(settings.allowed_file_roots)
    if scheme == "s3":
        return S3Store(settings, settings.allowed_buckets)
    raise StoreAccessDenied(f"unsupported artifact URI scheme {scheme!r}: use file:// or s3://")


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
