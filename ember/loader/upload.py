"""Push a local checkpoint to the object store: every file, in parallel, resumable.

What ``ember models push`` and ``ember models import-hf`` do before they register:

- ``list_directory`` takes a directory the way the registry will list it: hidden files and
  directories skipped, every path checked (``manifest.check_path``), a link followed only
  to a regular file inside the directory (or another place the caller allows: a Hugging
  Face cache's ``blobs/``), so a directory from elsewhere cannot carry, say,
  ``~/.aws/credentials`` into the store under the name ``tokenizer.json``.
- ``check_local`` makes the registry's checks (``ember.registry.validation``) on the
  local files, so a bad directory is refused before a byte is uploaded: the layout from
  the paths, every shard's header, every index against the shards beside it.
- ``digest_files`` hashes every file (in parallel; remembered per file in the user's cache
  keyed by size, mtime, ctime and inode, so a re-run after an interruption does not hash
  a large checkpoint again).
- ``Push.run`` puts the files under a prefix:

  - **S3**: a file larger than one part (``s3_part_size_bytes``) is a multipart upload;
    parts of all files go ``s3_max_concurrency`` at a time, each read from disk by the
    thread that sends it (memory: one part per thread). Every object carries its sha256
    in ``x-amz-meta-sha256``.
  - **Resume**: a file already in the store with the same size and sha256 is skipped. A
    multipart upload is recorded when it starts in a state file under
    ``~/.cache/ember/uploads/`` (one per endpoint, bucket and key, valid for the same
    size, mtime, sha256 and part size), so a re-run after Ctrl-C, a network failure or a
    killed process lists that upload's parts and keeps each one whose ETag is the MD5 of
    the local bytes; the rest are sent again. Every other multipart upload in progress
    for a key this push writes is aborted (a stale one, or one whose state is lost: its
    parts would otherwise be billed until a lifecycle rule removes them). An upload is
    resumed only when its state says it was started for these very bytes, because the
    sha256 it carries was fixed when it started.
  - **file://**: ``FileStore.put_file`` (written beside the target, fsync, rename); a
    re-run skips files whose stored bytes have the same sha256.

Torch-free: the CLI imports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat as statmod
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from ember.config import Settings
from ember.domain.manifest import ManifestFile, check_path, check_structure, hidden
from ember.domain.safetensors import PREFIX_BYTES, Header, parse_header, read_header_len
from ember.errors import ArtifactError, InvalidInput, ObjectNotFound, StoreAccessDenied
from ember.loader.stores import FileStore, ObjectStore, S3Store, join_uri, translate_s3_errors
from ember.logs import get_logger, submit_in_context

Progress = Callable[[int], None]
T = TypeVar("T")
log = get_logger(__name__)

MAX_PARTS = 10_000
"""S3's limit on the parts of one multipart upload: a larger file gets larger parts."""
STATE_FORMAT = 1
HASH_CHUNK_BYTES = 8 * 1024 * 1024
MIB = 1024 * 1024
MEMO_MIN_BYTES = 64 * MIB
"""Files from this size on have their digest remembered (smaller ones hash in no time)."""


@dataclass(frozen=True, slots=True)
class LocalFile:
    """One file of a push: where it goes in the version, where it is read from."""

    path: str
    """Its path in the version (a manifest path)."""
    source: Path
    """The local file read (links resolved)."""
    size: int
    mtime_ns: int
    sha256: str = ""
    """Set by ``digest_files``."""

    def entry(self) -> ManifestFile:
        return ManifestFile(path=self.path, size=self.size, sha256=self.sha256)


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/ember`` (default ``~/.cache/ember``): upload state and digests."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ember"


# --- what a push takes --------------------------------------------------------------------


def local_file(path: Path, name: str | None = None) -> LocalFile:
    """A single file pushed as it is (a one-file version), stored as ``name``."""
    real = Path(os.path.realpath(path))
    st = _regular(real, path.name)
    return LocalFile(check_path(name or path.name), real, st.st_size, st.st_mtime_ns)


def list_directory(
    root: Path,
    *,
    max_files: int,
    allowed: Sequence[Path] = (),
    allowed_name: str = "the directory",
) -> list[LocalFile]:
    """Every file of ``root`` a version takes, sorted by path (see the module docstring).

    A link is followed only when it resolves to a regular file under ``root`` or one of
    ``allowed`` (``allowed_name`` says which in the refusal); a link to a directory is
    never followed. ``InvalidInput`` beyond ``max_files``; ``ArtifactError`` otherwise."""
    base = Path(os.path.realpath(root))
    if not base.is_dir():
        raise ArtifactError(f"{root} is not a directory")
    fences = [base, *(Path(os.path.realpath(a)) for a in allowed)]
    found: list[LocalFile] = []
    for top, dirs, names in os.walk(base, followlinks=False):
        here = Path(top)
        rel_top = here.relative_to(base)
        for d in sorted(dirs):
            if not d.startswith(".") and os.path.islink(here / d):
                raise ArtifactError(
                    f"{(rel_top / d).as_posix()} is a link to a directory: not followed "
                    "(copy the files in, or push the directory it points to)"
                )
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            rel = (rel_top / name).as_posix()
            if hidden(rel):
                continue
            check_path(rel)
            if len(found) >= max_files:
                raise InvalidInput(
                    f"{root} holds more than {max_files} files (EMBER_MANIFEST_MAX_FILES)"
                )
            real = Path(os.path.realpath(here / name))
            if not any(real == f or f in real.parents for f in fences):
                raise ArtifactError(
                    f"{rel} is a link to {real}, outside {allowed_name}: refused (a link is "
                    f"followed only into {allowed_name})"
                )
            st = _regular(real, rel)
            found.append(LocalFile(rel, real, st.st_size, st.st_mtime_ns))
    if not found:
        raise ArtifactError(f"{root} holds no file (hidden files are skipped)")
    return sorted(found, key=lambda f: f.path)


def _regular(real: Path, shown_as: str) -> os.stat_result:
    try:
        st = real.stat()
    except FileNotFoundError:
        raise ArtifactError(f"{shown_as}: no such file (a broken link?)") from None
    if not statmod.S_ISREG(st.st_mode):
        raise ArtifactError(f"{shown_as} is not a regular file")
    return st


def check_local(files: Sequence[LocalFile], max_header_bytes: int) -> None:
    """The registry's checks of a directory version (``manifest.check_structure``), on the
    local files. Each error names the file (and the tensor)."""
    by_path = {f.path: f for f in files}
    check_structure(
        {f.path: f.size for f in files},
        lambda path: check_header(by_path[path], max_header_bytes),
        lambda path: by_path[path].source.read_bytes(),
        max_header_bytes=max_header_bytes,
    )


def check_header(f: LocalFile, max_header_bytes: int) -> Header:
    """``f``'s safetensors header, parsed defensively (``ArtifactError`` naming the file)."""
    try:
        with f.source.open("rb") as fh:
            prefix = fh.read(min(PREFIX_BYTES, f.size))
            header_len = read_header_len(prefix, f.size, max_header_bytes)
            return parse_header(fh.read(header_len), f.size)
    except ArtifactError as exc:
        raise ArtifactError(f"{f.path}: {exc.detail}", **{**exc.extra, "file": f.path}) from None


# --- digests ------------------------------------------------------------------------------


class Cancelled(Exception):
    """The push was interrupted; workers stop at their next chunk."""


def digest_files(
    files: Sequence[LocalFile],
    *,
    progress: Progress | None = None,
    threads: int = 4,
    cache_dir: Path | None = None,
    cancel: threading.Event | None = None,
) -> list[LocalFile]:
    """``files`` with their sha256, hashed ``threads`` at a time. With ``cache_dir``, a
    digest is remembered (``<cache_dir>/digests/``) and reused while the file's size,
    mtime, ctime and inode are unchanged; a file that changes while it is hashed is an
    ``ArtifactError``."""
    stop = cancel or threading.Event()
    with ThreadPoolExecutor(max(1, min(threads, len(files))), "ember-hash") as pool:
        tasks = [partial(_digest, f, progress, cache_dir, stop) for f in files]
        return run_all(tasks, pool, stop)


def _digest(
    f: LocalFile, progress: Progress | None, cache_dir: Path | None, cancel: threading.Event
) -> LocalFile:
    st = f.source.stat()
    identity = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    memo = None
    if cache_dir is not None and st.st_size >= MEMO_MIN_BYTES:
        memo = (
            cache_dir / "digests" / (hashlib.sha256(str(f.source).encode()).hexdigest() + ".json")
        )
        known = _read_json(memo)
        if known and known.get("identity") == identity and known.get("source") == str(f.source):
            if progress:
                progress(f.size)
            return replace(f, size=st.st_size, mtime_ns=st.st_mtime_ns, sha256=known["sha256"])
    digest = hashlib.sha256()
    with f.source.open("rb") as fh:
        while chunk := fh.read(HASH_CHUNK_BYTES):
            if cancel.is_set():
                raise Cancelled
            digest.update(chunk)
            if progress:
                progress(len(chunk))
    after = f.source.stat()
    if [
        after.st_size,
        after.st_mtime_ns,
        after.st_ctime_ns,
        after.st_ino,
        after.st_dev,
    ] != identity:
        raise ArtifactError(f"{f.path} changed while it was hashed: push it again once it is still")
    sha = digest.hexdigest()
    if memo is not None:  # best effort: a home without a writable cache only hashes again
        _write_json(memo, {"source": str(f.source), "identity": identity, "sha256": sha})
    return replace(f, size=st.st_size, mtime_ns=st.st_mtime_ns, sha256=sha)


def run_all(
    tasks: Sequence[Callable[[], T]], pool: ThreadPoolExecutor, cancel: threading.Event
) -> list[T]:
    """Run ``tasks`` on ``pool``; the first failure (or a KeyboardInterrupt in the caller)
    sets ``cancel`` and cancels what has not started, so the pool's exit waits only for
    the work already in flight (each task checks ``cancel`` between chunks)."""
    futures = [submit_in_context(pool, task) for task in tasks]
    try:
        for fut in as_completed(futures):
            fut.result()
    except BaseException:
        cancel.set()
        for fut in futures:
            fut.cancel()
        raise
    return [fut.result() for fut in futures]


# --- upload -------------------------------------------------------------------------------


@dataclass
class PushReport:
    """What one push did (complete also after a failure: what reached the store)."""

    uploaded: list[str] = field(default_factory=list)
    """Paths this run put in the store."""
    skipped: list[str] = field(default_factory=list)
    """Paths already in the store with the same size and sha256."""
    parts_sent: int = 0
    parts_kept: int = 0
    """Parts of an interrupted multipart upload found in the store and kept."""
    bytes_sent: int = 0
    bytes_kept: int = 0
    """Bytes not sent again: skipped files and kept parts."""
    aborted_uploads: int = 0
    """Stale multipart uploads aborted."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


def object_uri(prefix: str, path: str, store: ObjectStore) -> str:
    """Where the version's file ``path`` lies under ``prefix``: percent-quoted for
    ``file://`` (the store decodes it), the key as it is for ``s3://`` (S3 does not)."""
    if isinstance(store, FileStore):
        return join_uri(prefix, "/".join(quote(p, safe="") for p in path.split("/")))
    return join_uri(prefix, path)


def part_bytes(size: int, configured: int) -> int:
    """The part size for a file of ``size`` bytes: ``configured``, or larger (whole MiB)
    where ``configured`` would need more than ``MAX_PARTS`` parts."""
    need = math.ceil(size / MAX_PARTS)
    return configured if need <= configured else math.ceil(need / MIB) * MIB


class Push:
    """Upload files under a prefix of one store (see the module docstring)."""

    def __init__(
        self,
        store: ObjectStore,
        settings: Settings,
        *,
        state_dir: Path,
        progress: Progress | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.state_dir = state_dir
        self.progress = progress or (lambda n: None)
        self.report = PushReport()
        self.cancel = threading.Event()

    def run(self, files: Sequence[LocalFile], prefix: str) -> PushReport:
        """Every file at ``object_uri(prefix, f.path)``. Every destination is checked
        before the first byte is sent; ``KeyboardInterrupt`` stops the workers at their
        next chunk and propagates."""
        if isinstance(self.store, S3Store):
            _S3Push(self, self.store).run(files, prefix)
        elif isinstance(self.store, FileStore):
            self._file_run(self.store, files, prefix)
        else:  # pragma: no cover - only two stores
            raise TypeError(f"cannot push to {type(self.store).__name__}")
        return self.report

    def delete(self, files: Iterable[LocalFile], prefix: str) -> int:
        """Remove these files from the store (a push whose registration was refused)."""
        removed = 0
        for f in files:
            uri = object_uri(prefix, f.path, self.store)
            if isinstance(self.store, S3Store):
                bucket, key = self.store.split(uri)
                with translate_s3_errors(uri):
                    self.store.client.delete_object(Bucket=bucket, Key=key)
            elif isinstance(self.store, FileStore):
                self.store.path_of(uri).unlink(missing_ok=True)
            removed += 1
        return removed

    def advance(self, n: int) -> None:
        """Progress from a worker; raises ``Cancelled`` once the push is interrupted (a
        copy in ``FileStore.put_file`` stops and removes its temporary file)."""
        if self.cancel.is_set():
            raise Cancelled
        self.progress(n)

    # --- file:// ---

    def _file_run(self, store: FileStore, files: Sequence[LocalFile], prefix: str) -> None:
        targets = [(f, object_uri(prefix, f.path, store)) for f in files]
        for _, uri in targets:  # every refusal before any byte is written
            store.path_of(uri)
        with ThreadPoolExecutor(max(1, min(4, len(files))), "ember-push") as pool:
            run_all([partial(self._file_one, store, f, uri) for f, uri in targets], pool,
                    self.cancel)  # fmt: skip

    def _file_one(self, store: FileStore, f: LocalFile, uri: str) -> None:
        try:
            info = store.stat(uri)
        except ObjectNotFound:
            info = None
        if info is not None and info.size == f.size and store.sha256(uri)[0] == f.sha256:
            self.report.add(bytes_kept=f.size)
            self._done(f, skipped=True)
            self.progress(f.size)
            return
        store.put_file(f.source, uri, self.advance)
        check_unchanged(f)
        self.report.add(bytes_sent=f.size)
        self._done(f, skipped=False)

    def _done(self, f: LocalFile, *, skipped: bool) -> None:
        with self.report.lock:
            (self.report.skipped if skipped else self.report.uploaded).append(f.path)


def check_unchanged(f: LocalFile) -> None:
    """``ArtifactError`` if ``f`` changed since it was listed and hashed."""
    st = f.source.stat()
    if (st.st_size, st.st_mtime_ns) != (f.size, f.mtime_ns):
        raise ArtifactError(f"{f.path} changed while it was uploaded: push it again")


class _S3Push:
    """The S3 half of ``Push``: heads, multipart uploads and their resume."""

    def __init__(self, push: Push, store: S3Store) -> None:
        self.push = push
        self.store = store
        self.client = store.client
        self.report = push.report
        self.endpoint = store.settings.s3_endpoint_url or "aws"

    def run(self, files: Sequence[LocalFile], prefix: str) -> None:
        targets = [(f, *self.store.split(object_uri(prefix, f.path, self.store))) for f in files]
        bucket, key = self.store.split(prefix.rstrip("/") + "/x")
        in_progress = self._in_progress(bucket, key[:-1])
        concurrency = self.store.settings.s3_max_concurrency
        with (
            ThreadPoolExecutor(concurrency, "ember-put") as parts,
            ThreadPoolExecutor(max(1, min(4, len(files))), "ember-push") as pool,
        ):
            tasks = [partial(self._one, f, b, k, parts, in_progress) for f, b, k in targets]
            run_all(tasks, pool, self.push.cancel)

    def _in_progress(self, bucket: str, key_prefix: str) -> dict[str, set[str]] | None:
        """Multipart uploads in progress under the version's prefix, by key; None where
        the credentials may not list them (then only recorded uploads are resumed and
        none is aborted)."""
        found: dict[str, set[str]] = {}
        uri = f"s3://{bucket}/{key_prefix}"
        try:
            with translate_s3_errors(uri):
                pages = self.client.get_paginator("list_multipart_uploads")
                for page in pages.paginate(Bucket=bucket, Prefix=key_prefix):
                    for upload in page.get("Uploads", []):
                        found.setdefault(str(upload["Key"]), set()).add(str(upload["UploadId"]))
        except StoreAccessDenied:
            log.warning("cannot list multipart uploads: stale ones are not aborted", uri=uri)
            return None
        return found

    def _one(
        self,
        f: LocalFile,
        bucket: str,
        key: str,
        parts: ThreadPoolExecutor,
        in_progress: dict[str, set[str]] | None,
    ) -> None:
        uri = f"s3://{bucket}/{key}"
        state_file = self._state_file(bucket, key)
        state = _read_json(state_file)
        stale = set(in_progress.get(key, ())) if in_progress is not None else set()
        if state and isinstance(state.get("upload_id"), str):
            stale.add(state["upload_id"])
        head = self._head(bucket, key, uri)
        if head is not None and head == (f.size, f.sha256):
            self._abort(bucket, key, stale, uri)
            state_file.unlink(missing_ok=True)
            self.report.add(bytes_kept=f.size)
            self.push._done(f, skipped=True)
            self.push.progress(f.size)
            return
        part = part_bytes(f.size, self.store.settings.s3_part_size_bytes)
        if f.size <= self.store.settings.s3_part_size_bytes:
            self._abort(bucket, key, stale, uri)
            state_file.unlink(missing_ok=True)
            _wait(submit_in_context(parts, self._put, f, bucket, key, uri))
        else:
            self._multipart(f, bucket, key, uri, part, parts, state, in_progress, stale)
            state_file.unlink(missing_ok=True)
        self.push._done(f, skipped=False)

    def _multipart(
        self,
        f: LocalFile,
        bucket: str,
        key: str,
        uri: str,
        part: int,
        parts: ThreadPoolExecutor,
        state: dict[str, Any] | None,
        in_progress: dict[str, set[str]] | None,
        stale: set[str],
    ) -> None:
        count = math.ceil(f.size / part)
        want = self._identity(f, bucket, key, part)
        upload_id: str | None = None
        kept: dict[int, str] = {}
        if state is not None and {k: state.get(k) for k in want} == want:
            upload_id = str(state["upload_id"])
            if in_progress is not None and upload_id not in in_progress.get(key, ()):
                upload_id = None  # completed or aborted since: start again
            else:
                upload_id, kept = self._resume(f, bucket, key, uri, upload_id, part, parts)
        if upload_id is None:
            with translate_s3_errors(uri):
                created = self.client.create_multipart_upload(
                    Bucket=bucket, Key=key, Metadata={"sha256": f.sha256}
                )
            upload_id = str(created["UploadId"])
            record = {**want, "upload_id": upload_id, "source": str(f.source)}
            if not _write_json(self._state_file(bucket, key), record):
                log.warning("cannot record the upload: an interruption starts it again",
                            uri=uri, state_dir=str(self.push.state_dir))  # fmt: skip
        self._abort(bucket, key, stale - {upload_id}, uri)
        pending = [n for n in range(1, count + 1) if n not in kept]
        futures = [submit_in_context(parts, self._part, f, bucket, key, uri, upload_id, n, part)
                   for n in pending]  # fmt: skip
        etags = dict(kept)
        for n, etag in _gather(futures):
            etags[n] = etag
        check_unchanged(f)  # never complete an upload of bytes that moved meanwhile
        with translate_s3_errors(uri):
            self.client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n]}
                                           for n in sorted(etags)]},
            )  # fmt: skip
        if self._head(bucket, key, uri) != (f.size, f.sha256):
            raise ArtifactError(f"{f.path}: the store holds something else after the upload")

    def _resume(
        self,
        f: LocalFile,
        bucket: str,
        key: str,
        uri: str,
        upload_id: str,
        part: int,
        parts: ThreadPoolExecutor,
    ) -> tuple[str | None, dict[int, str]]:
        """The recorded upload and the parts worth keeping: each listed part of the right
        size whose ETag is the MD5 of the same local bytes."""
        listed: list[tuple[int, int, str]] = []
        try:
            with translate_s3_errors(uri):
                pages = self.client.get_paginator("list_parts")
                for page in pages.paginate(Bucket=bucket, Key=key, UploadId=upload_id):
                    for p in page.get("Parts", []):
                        listed.append((int(p["PartNumber"]), int(p["Size"]), str(p["ETag"])))
        except ObjectNotFound:  # NoSuchUpload: completed or aborted since
            return None, {}
        count = math.ceil(f.size / part)
        checks = [
            submit_in_context(parts, self._matches, f, n, part, etag)
            for n, size, etag in listed
            if 1 <= n <= count and size == _part_len(f.size, part, n)
        ]
        kept = {n: etag for n, etag, ok in _gather(checks) if ok}
        kept_bytes = sum(_part_len(f.size, part, n) for n in kept)
        self.report.add(parts_kept=len(kept), bytes_kept=kept_bytes)
        self.push.progress(kept_bytes)
        return upload_id, kept

    def _matches(self, f: LocalFile, n: int, part: int, etag: str) -> tuple[int, str, bool]:
        if self.push.cancel.is_set():
            raise Cancelled
        data = _read_part(f, n, part)
        return n, etag, etag.strip('"') == hashlib.md5(data, usedforsecurity=False).hexdigest()

    def _part(
        self, f: LocalFile, bucket: str, key: str, uri: str, upload_id: str, n: int, part: int
    ) -> tuple[int, str]:
        if self.push.cancel.is_set():
            raise Cancelled
        data = _read_part(f, n, part)
        with translate_s3_errors(uri):
            sent = self.client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=data
            )
        self.report.add(parts_sent=1, bytes_sent=len(data))
        self.push.progress(len(data))
        return n, str(sent["ETag"])

    def _put(self, f: LocalFile, bucket: str, key: str, uri: str) -> None:
        if self.push.cancel.is_set():
            raise Cancelled
        data = f.source.read_bytes()
        if len(data) != f.size:
            raise ArtifactError(f"{f.path} changed while it was uploaded: push it again")
        with translate_s3_errors(uri):
            self.client.put_object(Bucket=bucket, Key=key, Body=data, Metadata={"sha256": f.sha256})
        self.report.add(bytes_sent=len(data))
        self.push.progress(len(data))

    def _head(self, bucket: str, key: str, uri: str) -> tuple[int, str] | None:
        """The object's size and recorded sha256, or None if there is none."""
        try:
            with translate_s3_errors(uri):
                head = self.client.head_object(Bucket=bucket, Key=key)
        except ObjectNotFound:
            return None
        return int(head["ContentLength"]), str(head.get("Metadata", {}).get("sha256", ""))

    def _abort(self, bucket: str, key: str, upload_ids: Iterable[str], uri: str) -> None:
        for upload_id in sorted(upload_ids):
            try:
                with translate_s3_errors(uri):
                    self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            except ObjectNotFound:  # already completed or aborted
                continue
            self.report.add(aborted_uploads=1)
            log.info("aborted a stale multipart upload", uri=uri)

    def _identity(self, f: LocalFile, bucket: str, key: str, part: int) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "endpoint": self.endpoint, "bucket": bucket, "key": key,
                "size": f.size, "mtime_ns": f.mtime_ns, "sha256": f.sha256,
                "part_bytes": part}  # fmt: skip

    def _state_file(self, bucket: str, key: str) -> Path:
        name = hashlib.sha256(f"{self.endpoint}\n{bucket}\n{key}".encode()).hexdigest()[:40]
        return self.push.state_dir / f"{name}.json"


def _part_len(size: int, part: int, n: int) -> int:
    """Bytes in part ``n`` (from 1) of a ``size``-byte file cut in ``part``-byte parts."""
    return min(part, size - (n - 1) * part)


def _read_part(f: LocalFile, n: int, part: int) -> bytes:
    offset = (n - 1) * part
    length = _part_len(f.size, part, n)
    with f.source.open("rb") as fh:
        data = os.pread(fh.fileno(), length, offset)
    if len(data) != length:
        raise ArtifactError(f"{f.path} changed while it was uploaded: push it again")
    return data


def _wait(future: Future[T]) -> T:
    return _gather([future])[0]


def _gather(futures: Sequence[Future[T]]) -> list[T]:
    """Results in completion order; the first failure cancels the rest and raises."""
    results: list[T] = []
    try:
        for fut in as_completed(futures):
            results.append(fut.result())
    except BaseException:
        for fut in futures:
            fut.cancel()
        raise
    return results


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _write_json(path: Path, doc: dict[str, Any]) -> bool:
    """Atomically, in a directory only the user can read; False where it cannot be."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp.write_text(json.dumps(doc, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False
    return True
