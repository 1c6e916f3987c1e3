"""Object stores behind one small interface: ``file://`` and ``s3://``.

``open_store(uri, settings)`` checks that the URI is allowed (file roots, bucket allowlist)
before anything is read, so an artifact URI can never escape the configured locations —
not with ``..``, not through a symlink. ``open_store(uri, settings, tenant=...)`` confines
the store further to that tenant's own prefixes (``tenant_prefixes``): every URI is parsed
strictly first (``parse_location``: no ``..``, ``.`` or empty segments, percent-encoded or
not, no ``?``, ``#``, backslash or control character), then checked against the prefixes
lexically and, for ``file://``, resolved one component at a time without ever looking
outside the prefix, so a refusal is the same whether or not anything exists where the URI
points. No refusal names a server path. botocore errors are translated to Ember's
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
import re
import stat as statmod
import tempfile
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import quote, unquote, urlsplit

from ember.config import Settings
from ember.errors import (
    InvalidInput,
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

    @abstractmethod
    def list_dir(self, uri: str, max_files: int) -> list[tuple[str, ObjectInfo]]:
        """Every object under the directory ``uri`` (ending in ``/``) as ``(path relative
        to it, info)``, sorted by path, hidden files and directories (a part starting with
        ``.``) left out; ``InvalidInput`` beyond ``max_files``, ``ObjectNotFound`` if none.
        A link out of the allowed locations is refused, never followed."""

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
    """Local files confined to ``roots``, or, given ``prefixes``, to those directories
    alone (a tenant's). Paths are resolved one component at a time (``resolve_path``):
    no link leads out of the roots, out of a prefix, or out of a directory ``fenced``
    names (each tenant's part of the object store and of the extra roots), for any caller.
    """

    def __init__(
        self,
        roots: list[Path],
        prefixes: list[Path] | None = None,
        *,
        fenced: Callable[[Path], bool] | None = None,
        denied: Callable[[str], StoreAccessDenied] | None = None,
    ) -> None:
        self.roots = [Path(os.path.realpath(r)) for r in roots]
        self.prefixes = prefixes
        self.fenced = fenced
        self._denied = denied

    def path_of(self, uri: str) -> Path:
        location = parse_location(uri)
        if location.scheme != "file":
            raise StoreAccessDenied(f"{shown(uri)} is not a local file:// URI")
        path = Path(location.path)
        if self.prefixes is not None:
            for prefix in self.prefixes:
                if _under(path, prefix):
                    real = resolve_path(path, fence=prefix)
                    if real is not None:
                        return real
            raise (
                self._denied(uri)
                if self._denied is not None
                else StoreAccessDenied(f"{shown(uri)} is outside the allowed prefixes")
            )
        real = resolve_path(path, fenced=self.fenced)
        if real is None or not any(_under(real, r) for r in self.roots):
            raise StoreAccessDenied(
                f"{shown(uri)} resolves outside the allowed file roots (the object store "
                "and EMBER_FILE_ROOTS), or through a link out of its tenant's directory"
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

    def list_dir(self, uri: str, max_files: int) -> list[tuple[str, ObjectInfo]]:
        base = _directory(uri)
        root = self.path_of(base)
        if not root.is_dir():
            raise ObjectNotFound(f"{shown(uri)} is not a directory")
        found: list[tuple[str, ObjectInfo]] = []
        for top, dirs, files in os.walk(root, followlinks=False):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            rel_top = Path(top).relative_to(root).as_posix()
            for name in sorted(files):
                if name.startswith("."):
                    continue
                rel = name if rel_top == "." else f"{rel_top}/{name}"
                if len(found) >= max_files:
                    raise InvalidInput(
                        f"{shown(uri)} holds more than {max_files} files (EMBER_MANIFEST_MAX_FILES)"
                    )
                child = base + "/".join(quote(p, safe="") for p in rel.split("/"))
                found.append((rel, self.stat(child)))  # a link out of the roots is refused
        if not found:
            raise ObjectNotFound(f"no file under {shown(uri)}")
        return sorted(found)

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

    def __init__(
        self,
        settings: Settings,
        allowed_buckets: set[str],
        prefixes: list[tuple[str, tuple[str, ...]]] | None = None,
        *,
        denied: Callable[[str], StoreAccessDenied] | None = None,
    ) -> None:
        self.settings = settings
        self.allowed_buckets = allowed_buckets
        self.prefixes = prefixes
        """``(bucket, key segments)``: given, the only places this store reads or writes."""
        self._denied = denied
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
        location = parse_location(uri)
        if location.scheme != "s3" or not location.segments:
            raise StoreAccessDenied(f"{shown(uri)} is not an s3://bucket/key URI")
        bucket, parts = location.bucket, location.segments
        if self.prefixes is not None:
            if not any(_s3_under(bucket, parts, p) for p in self.prefixes):
                raise (
                    self._denied(uri)
                    if self._denied is not None
                    else StoreAccessDenied(f"{shown(uri)} is outside the allowed prefixes")
                )
        elif "*" not in self.allowed_buckets and bucket not in self.allowed_buckets:
            raise StoreAccessDenied(
                f"bucket {bucket!r} is not allowed (the object store's bucket and "
                "EMBER_S3_ALLOWED_BUCKETS are); set EMBER_S3_ALLOWED_BUCKETS"
            )
        return bucket, location.key

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

    def list_dir(self, uri: str, max_files: int) -> list[tuple[str, ObjectInfo]]:
        base = _directory(uri)
        bucket, key = self.split(base + "x")
        prefix = key[:-1]
        found: list[tuple[str, ObjectInfo]] = []

        def pages() -> Iterator[dict[str, Any]]:
            paginator = self.client.get_paginator("list_objects_v2")
            with translate_s3_errors(uri):
                yield from paginator.paginate(Bucket=bucket, Prefix=prefix)  # type: ignore[misc]

        for page in pages():
            for obj in page.get("Contents", []):
                rel = str(obj["Key"])[len(prefix) :]
                if not rel or rel.endswith("/") or any(p.startswith(".") for p in rel.split("/")):
                    continue  # a directory marker, or hidden
                if len(found) >= max_files:
                    raise InvalidInput(
                        f"{shown(uri)} holds more than {max_files} files (EMBER_MANIFEST_MAX_FILES)"
                    )
                child = f"s3://{bucket}/{obj['Key']}"
                self.split(child)  # a key the store would not read as itself is refused
                found.append((rel, ObjectInfo(child, int(obj["Size"]), str(obj["ETag"]))))
        if not found:
            raise ObjectNotFound(f"no object under {shown(uri)}")
        return sorted(found)

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


def open_store(
    uri: str, settings: Settings, *, tenant: str | None = None, area: Area = "artifacts"
) -> ObjectStore:
    """The store for ``uri``, with the access limits from ``settings``; with ``tenant``,
    confined to that tenant's prefixes for ``area`` (``tenant_prefixes``)."""
    scheme = _scheme(uri)
    if scheme not in ("file", "s3"):
        raise StoreAccessDenied(
            f"unsupported artifact URI scheme {scheme[:20]!r}: use file:// or s3://"
        )
    denied = None if tenant is None else _tenant_refusal(tenant, area)
    if scheme == "file":
        files = None if tenant is None else _file_prefixes(settings, tenant, area)
        return FileStore(
            settings.allowed_file_roots, files, fenced=_partitions(settings), denied=denied
        )
    buckets = None if tenant is None else _s3_prefixes(settings, tenant, area)
    return S3Store(settings, settings.allowed_buckets, buckets, denied=denied)


def check_location(
    uri: str, settings: Settings, *, tenant: str | None = None, area: Area = "artifacts"
) -> None:
    """Refuse ``uri`` (``StoreAccessDenied``) unless it is an allowed place — with
    ``tenant``, one of that tenant's — without reading the object: for a URI named before
    it exists (an output) or checked before anything else is done with it."""
    store = open_store(uri, settings, tenant=tenant, area=area)
    if isinstance(store, FileStore):
        store.path_of(uri)
    elif isinstance(store, S3Store):
        store.split(uri)


# --- where a URI may point: strict parsing and each tenant's prefixes -----------------

#: The object store's areas; a tenant's part of each is ``<store>/<area>/<tenant>/``.
Area = Literal["artifacts", "job-inputs", "batch"]

_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: Symbolic links followed at most while resolving one path (the kernel's own limit).
MAX_SYMLINKS = 40


@dataclass(frozen=True, slots=True)
class Location:
    """A URI parsed strictly: what the store reads is exactly what was checked."""

    scheme: Literal["file", "s3"]
    bucket: str
    """The bucket of an ``s3://`` URI; empty for ``file://``."""
    segments: tuple[str, ...]
    """The path's segments: decoded for ``file://`` (what is opened), as written for
    ``s3://`` (the key; S3 does not decode it)."""
    directory: bool
    """The URI ended with ``/``."""

    @property
    def path(self) -> str:
        return "/" + "/".join(self.segments)

    @property
    def key(self) -> str:
        return "/".join(self.segments) + ("/" if self.directory and self.segments else "")


def _directory(uri: str) -> str:
    """``uri`` as a directory URI (ending in ``/``)."""
    return uri if uri.endswith("/") else uri + "/"


def _scheme(uri: object) -> str:
    if not isinstance(uri, str):
        return ""
    try:
        return urlsplit(uri).scheme
    except ValueError:
        return ""


def shown(uri: object) -> str:
    """A URI as an error may repeat it: the caller's own text, quoted and bounded."""
    text = repr(uri)
    return text if len(text) <= 300 else text[:297] + "..."


def parse_location(uri: str) -> Location:
    """``uri`` parsed the way the stores will use it, or ``StoreAccessDenied``.

    Refused before any I/O, for every caller: a query or fragment (``?``, ``#``: a part
    of the URI the stores would drop), a backslash or control character, a ``.`` or
    ``..`` segment or an empty one (also percent-encoded: ``%2e%2e``, ``%2f``), a bad
    percent escape, a ``file://`` URI that is not an absolute local path, an ``s3://``
    URI whose host is not a bucket name."""
    if not isinstance(uri, str) or len(uri) > 4096:
        raise StoreAccessDenied(
            "a location must be a file:// or s3:// URI of at most 4096 characters"
        )
    for char, what in (("?", "a query ('?')"), ("#", "a fragment ('#')"),
                       ("\\", "a backslash")):  # fmt: skip
        if char in uri:
            raise StoreAccessDenied(f"{shown(uri)} must not contain {what}")
    if _CONTROL.search(uri):
        raise StoreAccessDenied(f"{shown(uri)} must not contain control characters")
    try:
        parts = urlsplit(uri)
    except ValueError as exc:  # e.g. an unbalanced '[' in the host
        raise StoreAccessDenied(f"{shown(uri)} is not a valid URI") from exc
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise StoreAccessDenied(f"{shown(uri)} is not a local file:// URI")
        if not parts.path.startswith("/"):
            raise StoreAccessDenied(f"{shown(uri)} is not an absolute file path")
    elif parts.scheme == "s3":
        if not _BUCKET.match(parts.netloc):
            raise StoreAccessDenied(f"{shown(uri)} is not an s3://bucket/key URI")
        if parts.path and not parts.path.startswith("/"):
            raise StoreAccessDenied(f"{shown(uri)} is not an s3://bucket/key URI")
    else:
        raise StoreAccessDenied(
            f"unsupported URI scheme {parts.scheme[:20]!r}: use file:// or s3://"
        )
    raw = parts.path[1:].split("/") if parts.path not in ("", "/") else []
    directory = parts.path.endswith("/")
    if raw and raw[-1] == "":
        raw.pop()
    decoded: list[str] = []
    for segment in raw:
        if _PERCENT.search(segment):
            raise StoreAccessDenied(f"{shown(uri)} has a malformed percent escape")
        try:
            plain = unquote(segment, errors="strict")
        except UnicodeDecodeError as exc:
            raise StoreAccessDenied(f"{shown(uri)} has a percent escape that is not UTF-8") from exc
        if plain in ("", ".", ".."):  # as written or percent-encoded
            raise StoreAccessDenied(
                f"{shown(uri)} must not contain empty, '.' or '..' path segments"
            )
        if "/" in plain or "\\" in plain or _CONTROL.search(plain):
            raise StoreAccessDenied(
                f"{shown(uri)} must not encode '/', a backslash or a control character"
            )
        decoded.append(plain)
    if parts.scheme == "file":
        return Location("file", "", tuple(decoded), directory)
    return Location("s3", parts.netloc, tuple(raw), directory)


def resolve_path(
    path: Path, *, fence: Path | None = None, fenced: Callable[[Path], bool] | None = None
) -> Path | None:
    """``path`` (absolute, without ``..``) with every symbolic link followed, one
    component at a time, or None where the resolution leaves its fence: ``fence`` from
    the start (a tenant's prefix: ``path`` must lie under it, and nothing outside it is
    looked at), or the first directory ``fenced`` names once the resolution enters it (a
    tenant's part of a store), narrowed by each further one. A link that leads out of the
    fence, or out and back in, is refused; as nothing outside the fence is looked at, the
    refusal says nothing about what exists there."""
    if fence is not None:
        if Path(os.path.realpath(fence)) != fence:  # the fence itself: no link on the way
            return None
        if not _under(path, fence):
            return None
        current = fence
        pending = list(reversed(path.relative_to(fence).parts))
    else:
        current = Path("/")
        pending = list(reversed(path.parts[1:]))
    links = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":  # only from a link's target: a URI's own segments have none
            if fence is not None and current == fence:
                return None
            current = current.parent
            continue
        candidate = current / part
        try:
            mode = os.lstat(candidate).st_mode
        except OSError:
            # Absent (or a file on the way): no link below it can be followed; the rest is
            # taken as written, and the read fails where it is.
            rest = [p for p in reversed(pending) if p not in ("", ".")]
            return None if ".." in rest else candidate.joinpath(*rest)
        if not statmod.S_ISLNK(mode):
            current = candidate
            if fenced is not None and fenced(current):
                fence = current
            continue
        links += 1
        if links > MAX_SYMLINKS:
            return None
        try:
            target = os.readlink(candidate)
        except OSError:
            return None
        if os.path.isabs(target):
            inside = Path(target).parts[1:]
            if fence is None:
                current = Path("/")
                pending.extend(reversed(inside))
                continue
            mine = fence.parts[1:]
            if tuple(inside[: len(mine)]) != mine:
                return None
            current = fence
            pending.extend(reversed(inside[len(mine) :]))
        else:
            pending.extend(reversed(target.split("/")))
    return current


def _partitions(settings: Settings) -> Callable[[Path], bool]:
    """Whether a (real) directory is one tenant's part of a store: ``<store>/<area>/<x>``
    of a ``file://`` object store, ``<root>/<x>`` of an extra file root."""
    store_root = _file_store_root(settings)
    extra = {Path(os.path.realpath(r)) for r in settings.file_roots}

    def fenced(path: Path) -> bool:
        return path.parent in extra or (store_root is not None and path.parent.parent == store_root)

    return fenced


def _file_store_root(settings: Settings) -> Path | None:
    """The ``file://`` object store's directory (its real path); None for S3."""
    store = urlsplit(settings.store_url)
    return Path(os.path.realpath(unquote(store.path))) if store.scheme == "file" else None


def _under(path: Path, prefix: Path) -> bool:
    return path == prefix or prefix in path.parents


def _s3_under(bucket: str, parts: tuple[str, ...], prefix: tuple[str, tuple[str, ...]]) -> bool:
    """Whether ``s3://bucket/<parts>`` lies strictly below ``prefix`` (bucket, key segments)."""
    in_bucket, keys = prefix
    return bucket == in_bucket and len(parts) > len(keys) and parts[: len(keys)] == keys


def _overlaps(a: Path, b: Path) -> bool:
    return _under(a, b) or _under(b, a)


def _file_prefixes(settings: Settings, tenant: str, area: Area) -> list[Path]:
    """``<object store>/<area>/<tenant>`` and ``<root>/<tenant>`` of every extra file
    root, leaving out one that overlaps what no tenant may read (the data directory, the
    weight cache, the object store, the prediction log, another root)."""
    found: list[Path] = []
    store_root = _file_store_root(settings)
    if store_root is not None:
        found.append(store_root / area / tenant)
    extra = [Path(os.path.realpath(r)) for r in settings.file_roots]
    private = [Path(os.path.realpath(settings.data_dir)),
               Path(os.path.realpath(settings.weight_cache_dir))]  # fmt: skip
    if store_root is not None:
        private.append(store_root)
    log_target = urlsplit(settings.prediction_log_target)
    if log_target.scheme == "file":
        private.append(Path(os.path.realpath(unquote(log_target.path))))
    for root in extra:
        if root == store_root:
            continue
        prefix = root / tenant
        if any(_overlaps(prefix, p) for p in private):
            continue
        if any(o != root and _under(o, prefix) for o in extra):
            continue
        found.append(prefix)
    return found


def _s3_segments(url: str) -> tuple[str, tuple[str, ...]] | None:
    parts = urlsplit(url)
    if parts.scheme != "s3":
        return None
    return parts.netloc, tuple(p for p in parts.path.split("/") if p)


def _s3_prefixes(settings: Settings, tenant: str, area: Area) -> list[tuple[str, tuple[str, ...]]]:
    """``<store>/<area>/<tenant>`` when the object store is S3, and ``<bucket>/<tenant>``
    of every bucket named in ``EMBER_S3_ALLOWED_BUCKETS`` (``*`` gives tenants nothing),
    leaving out one that overlaps the object store or the prediction log."""
    found: list[tuple[str, tuple[str, ...]]] = []
    store = _s3_segments(settings.store_url)
    if store is not None:
        found.append((store[0], (*store[1], area, tenant)))
    private = [p for p in (store, _s3_segments(settings.prediction_log_target)) if p]
    for bucket in sorted(settings.s3_allowed_buckets):
        if bucket == "*":
            continue
        mine = (tenant,)
        if any(
            b == bucket and (mine[: len(keys)] == keys or keys[: len(mine)] == mine)
            for b, keys in private
        ):
            continue
        found.append((bucket, mine))
    return found


def tenant_prefixes(settings: Settings, tenant: str, area: Area = "artifacts") -> list[str]:
    """The URI prefixes ``tenant`` may name for ``area``, each ending with ``/`` (server
    paths: for the operator and the tests, never for an error)."""
    files = [p.as_uri() + "/" for p in _file_prefixes(settings, tenant, area)]
    buckets = ["s3://" + "/".join((b, *k)) + "/" for b, k in _s3_prefixes(settings, tenant, area)]
    return files + buckets


def under_tenant_prefix(
    uri: str, settings: Settings, tenant: str, area: Area = "artifacts"
) -> bool:
    """Whether ``uri`` names a place under one of ``tenant``'s prefixes, as written (no
    I/O; links are ``resolve_path``'s business)."""
    try:
        location = parse_location(uri)
    except StoreAccessDenied:
        return False
    if location.scheme == "file":
        path = Path(location.path)
        return any(_under(path, p) for p in _file_prefixes(settings, tenant, area))
    return any(
        _s3_under(location.bucket, location.segments, p)
        for p in _s3_prefixes(settings, tenant, area)
    )


def _tenant_refusal(tenant: str, area: Area) -> Callable[[str], StoreAccessDenied]:
    def refuse(uri: str) -> StoreAccessDenied:
        return StoreAccessDenied(
            f"{shown(uri)} is not under tenant {tenant!r}'s own prefix: the object store's "
            f"{area}/{tenant}/, or {tenant}/ at the top of an extra file root or allowed "
            "bucket (only admin keys may name other locations)"
        )

    return refuse


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
