"""The NVMe weight cache: content-addressed, single-flight, atomic, verified, LRU.

Layout under ``EMBER_CACHE_DIR``: one directory per tenant, ``t<tenant id>/`` (0700, its
replicas' uid's where they run as one: ``tenant_cache_dir``), each a cache of its own
with its own budget; a replica's cache root *is* its tenant's directory, the API's warm
set names the tenant in the key (``CacheKey.tenant``)::

    .lock                                   the cache's lock: budget accounting and eviction
    .trash/                                 evicted entries on their way out
    v1/<model>/<version>/<sha256>/          a single-file version (the key's sha256 is its own)
        weights.safetensors                 complete and verified (appears only by rename)
        weights.safetensors.part            a fill in progress or interrupted
        part.json                           etag + size the partial bytes came from
        meta.json                           model, version, sha256, size, source, verified_at
        fill.lock                           flock: held EX by the one filler (or verifier)
        pin.lock                            flock: held SH by every live replica using it
    v1/<model>/<version>/<manifest>/        a directory version, keyed by its manifest's digest
        f/<sha256>/                         one entry per file (its sha256): as above, the
                                            file's bytes in weights.safetensors whatever it is
        tree/                               links named as the version's files (config,
                                            tokenizer, ...) to their verified entries

Why file locks: ``flock`` locks belong to the open file description, so they exclude
threads of one process (each opens its own descriptor) as well as other processes, and
the kernel drops them when a process dies — a crashed replica never leaves a stale pin,
a crashed filler never leaves a stale lock. A fill writes ``.part`` sequentially while
hashing; only a digest equal to the key's sha256 is renamed to ``weights.safetensors``,
so a half file can never look complete. An interrupted fill resumes from its ``.part``
when the object's ETag and size are unchanged (the prefix is re-hashed), else restarts.

Torch-free: the control plane (``ember cache``) imports this module.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from ember.config import Settings
from ember.errors import ArtifactError, LoaderError
from ember.loader.stores import ObjectInfo, ObjectStore
from ember.logs import get_logger

log = get_logger(__name__)

WEIGHTS = "weights.safetensors"
PART = WEIGHTS + ".part"
_HASH_CHUNK = 8 * 1024 * 1024

#: Called with (offset in the object, bytes) for every chunk as it is filled or re-read.
ChunkSink = Callable[[int, memoryview], None]


class CacheFull(LoaderError):
    status = 507
    code = "cache-full"
    title = "Weight cache full"


class EntryPinned(LoaderError):
    status = 409
    code = "cache-entry-pinned"
    title = "Cache entry in use"


class CacheLockTimeout(LoaderError):
    status = 503
    code = "cache-lock-timeout"
    title = "Cache entry busy"


def tenant_cache_dir(root: Path, tenant_id: int) -> Path:
    """Tenant ``tenant_id``'s weight cache under the cache root ``root``."""
    return root / f"t{int(tenant_id)}"


@dataclass(frozen=True, slots=True)
class CacheKey:
    model: str
    version: str
    sha256: str
    tenant: int | None = None
    """The tenant's directory under this cache's root (``tenant_cache_dir``); None where
    the root is the tenant's directory already (a replica's cache)."""
    manifest: str | None = None
    """The digest of the directory version this file belongs to (None: a single-file
    version, whose own sha256 is the key)."""

    def __post_init__(self) -> None:
        if not self.model or not self.version or "\x00" in self.model + self.version:
            raise LoaderError(f"invalid cache key {self.model!r}:{self.version!r}")
        for digest in (self.sha256, self.manifest):
            if digest is not None and not _is_digest(digest):
                raise LoaderError(f"cache key needs a lowercase hex sha256, got {digest!r}")

    def __str__(self) -> str:
        return f"{self.model}:{self.version}"


@dataclass(frozen=True, slots=True)
class CacheEntry:
    key: CacheKey
    path: Path
    """The entry's directory."""
    size: int
    """Bytes on disk (declared size for a fill in progress)."""
    complete: bool
    last_used: float
    pinned: bool
    filling: bool
    source_uri: str | None


@dataclass(frozen=True, slots=True)
class FillResult:
    path: Path
    bytes_fetched: int
    """Bytes read from the object store (less than the size when a fill resumed)."""
    bytes_resumed: int
    seconds: float


def _is_digest(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _component(name: str) -> str:
    """A name as one safe path component (no '/', no '.' or '..', bounded length)."""
    quoted = quote(name, safe="")
    if quoted in (".", "..") or len(quoted) > 200:
        return "~" + hashlib.sha256(name.encode()).hexdigest()[:40]
    return quoted


def _give_to_dir_owner(path: Path, fd: int | None = None) -> None:
    """As root, what this process just made in a directory of another user (a tenant's
    cache directory, its replicas' uid's) becomes that user's, so its replicas can still
    fill, pin and evict there (the API's warm set pins entries as root)."""
    if os.geteuid() != 0:
        return
    parent = path.parent.stat()
    if parent.st_uid == 0:
        return
    if fd is not None:
        os.fchown(fd, parent.st_uid, parent.st_gid)
    else:
        os.chown(path, parent.st_uid, parent.st_gid, follow_symlinks=False)


def _make_dirs(path: Path) -> None:
    """``mkdir -p path``, each directory made given to its parent's owner (as root)."""
    missing: list[Path] = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for made in reversed(missing):
        try:
            made.mkdir()
        except FileExistsError:
            continue
        _give_to_dir_owner(made)


class _Flock:
    """One flock on one freshly opened descriptor (see the module docstring for why)."""

    def __init__(self, path: Path) -> None:
        _make_dirs(path.parent)
        self.path = path
        flags = os.O_RDWR | os.O_NOFOLLOW  # a lock is never a link (a replica's uid's plant)
        try:
            self.fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self.fd = os.open(path, flags)
        else:
            _give_to_dir_owner(path, self.fd)

    def try_lock(self, op: int) -> bool:
        try:
            fcntl.flock(self.fd, op | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def lock(self, op: int, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        delay = 0.005
        while not self.try_lock(op):
            if time.monotonic() > deadline:
                self.close()
                raise CacheLockTimeout(f"{what}: still busy after {timeout_s:g}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def still_linked(self) -> bool:
        """False when the file was renamed away (evicted) after we opened it."""
        try:
            return os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1


class Pin:
    """A live replica's claim on an entry (or on every file entry of a directory version):
    eviction skips it until ``release``."""

    def __init__(self, lock: _Flock | list[_Flock], key: CacheKey) -> None:
        self._locks = lock if isinstance(lock, list) else [lock]
        self.key = key

    @classmethod
    def joined(cls, pins: list[Pin], key: CacheKey) -> Pin:
        """One pin holding all of ``pins`` (a directory version's files)."""
        return cls([lock for p in pins for lock in p._locks], key)

    def release(self) -> None:
        for lock in self._locks:
            lock.close()

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class WeightCache:
    """See the module docstring. One instance per process is enough; it holds no state
    besides its settings (everything shared lives in the file system)."""

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        *,
        verify_after_s: float = 24 * 3600.0,
        lock_timeout_s: float = 1800.0,
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.verify_after_s = verify_after_s
        self.lock_timeout_s = lock_timeout_s

    @classmethod
    def from_settings(cls, settings: Settings) -> WeightCache:
        return cls(
            settings.weight_cache_dir,
            settings.cache_max_bytes,
            verify_after_s=settings.cache_verify_after_s,
            lock_timeout_s=settings.cache_lock_timeout_s,
        )

    # --- paths ---------------------------------------------------------------------
    def version_dir(self, key: CacheKey) -> Path:
        """The directory of the key's version: where a single-file version's entry is, or
        the directory of a directory version's file entries and tree."""
        root = self.root if key.tenant is None else tenant_cache_dir(self.root, key.tenant)
        base = root / "v1" / _component(key.model) / _component(key.version)
        return base / (key.manifest or key.sha256)

    def entry_dir(self, key: CacheKey) -> Path:
        if key.manifest is None:
            return self.version_dir(key)
        return self.version_dir(key) / "f" / key.sha256

    def weights_path(self, key: CacheKey) -> Path:
        return self.entry_dir(key) / WEIGHTS

    def tree(self, files: dict[str, CacheKey]) -> Path:
        """A directory of links named as a directory version's files (relative path ->
        the file's key, all of one manifest), each to its entry's verified bytes: what an
        engine reads as the model's directory. Fill the entries first; pin them while the
        tree is used (a link to an evicted entry dangles). Rebuilt when it differs."""
        keys = set(files.values())
        if len({k.manifest for k in keys}) != 1 or next(iter(keys)).manifest is None:
            raise LoaderError("a tree is made of the files of one directory version")
        any_key = next(iter(keys))
        base = self.version_dir(any_key)
        tree = base / "tree"
        lock = _Flock(base / "tree.lock")
        lock.lock(fcntl.LOCK_EX, self.lock_timeout_s, f"tree of {any_key}")
        try:
            want = {
                path: os.path.relpath(self.weights_path(key), (tree / path).parent)
                for path, key in files.items()
            }
            if _links_are(tree, want):
                return tree
            tmp = base / f".tree.{uuid.uuid4().hex}"
            for path, target in want.items():
                link = tmp / path
                _make_dirs(link.parent)
                os.symlink(target, link)
            if tree.exists():
                old = self.root / ".trash" / uuid.uuid4().hex
                _make_dirs(old.parent)
                os.replace(tree, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, tree)
            return tree
        finally:
            lock.close()

    # --- locks ---------------------------------------------------------------------
    def pin(self, key: CacheKey) -> Pin:
        """Pin ``key`` (whether or not it is filled yet) until the pin is released."""
        while True:
            lock = _Flock(self.entry_dir(key) / "pin.lock")
            lock.lock(fcntl.LOCK_SH, self.lock_timeout_s, f"pin {key}")
            if lock.still_linked():
                return Pin(lock, key)
            lock.close()  # evicted between open and lock: pin the fresh directory

    @contextmanager
    def fill_lock(self, key: CacheKey) -> Iterator[None]:
        """Exclusive right to fill, verify or discard ``key`` (threads and processes)."""
        while True:
            lock = _Flock(self.entry_dir(key) / "fill.lock")
            lock.lock(fcntl.LOCK_EX, self.lock_timeout_s, f"fill of {key}")
            if lock.still_linked():
                break
            lock.close()
        try:
            yield
        finally:
            lock.close()

    @contextmanager
    def _global_lock(self) -> Iterator[None]:
        lock = _Flock(self.root / ".lock")
        lock.lock(fcntl.LOCK_EX, self.lock_timeout_s, "cache budget")
        try:
            yield
        finally:
            lock.close()

    # --- lookups -------------------------------------------------------------------
    def _meta(self, key: CacheKey) -> dict[str, Any] | None:
        try:
            meta = json.loads((self.entry_dir(key) / "meta.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return meta if isinstance(meta, dict) and meta.get("sha256") == key.sha256 else None

    def lookup(self, key: CacheKey) -> Path | None:
        """The complete entry, if it exists and needs no verification now (touches LRU)."""
        path = self.weights_path(key)
        meta = self._meta(key)
        if meta is None or not path.is_file() or path.stat().st_size != meta.get("size"):
            return None
        if time.time() - float(meta.get("verified_at", 0)) > self.verify_after_s:
            return None
        with suppress(FileNotFoundError):
            os.utime(path)
            return path
        return None

    def checked(self, key: CacheKey) -> Path | None:
        """Like ``lookup``, but re-hashes an entry whose verification is due and discards
        it when the digest is wrong. Call it holding ``fill_lock(key)``."""
        path = self.weights_path(key)
        meta = self._meta(key)
        if meta is None or not path.is_file():
            return None
        if path.stat().st_size == meta.get("size"):
            if time.time() - float(meta.get("verified_at", 0)) <= self.verify_after_s:
                os.utime(path)
                return path
            digest = sha256_file(path)
            if digest == key.sha256:
                meta["verified_at"] = time.time()
                _write_json(self.entry_dir(key) / "meta.json", meta)
                os.utime(path)
                return path
        log.error(
            "cache entry corrupt, discarding it", key=str(key), path=str(path),
            expected_sha256=key.sha256,
        )  # fmt: skip
        path.unlink(missing_ok=True)
        (self.entry_dir(key) / "meta.json").unlink(missing_ok=True)
        return None

    # --- fill ----------------------------------------------------------------------
    def fill(
        self,
        key: CacheKey,
        store: ObjectStore,
        info: ObjectInfo,
        sink: ChunkSink | None = None,
    ) -> FillResult:
        """Fetch ``info.uri`` into the entry, feeding every chunk to ``sink`` in order.

        Call it holding ``fill_lock(key)``. Raises ``ArtifactError`` when the object's
        digest is not ``key.sha256`` (the partial file is removed: the source is bad).
        """
        started = time.perf_counter()
        entry = self.entry_dir(key)
        entry.mkdir(parents=True, exist_ok=True)
        part = entry / PART
        hasher = hashlib.sha256()
        self.make_room(info.size, keep=key)
        resumed = self._resume(entry, info, hasher, sink)
        fetched = 0
        fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, resumed)
            for offset, data in store.iter_parts(info.uri, info, start=resumed):
                view = memoryview(data)
                _write_all(fd, view, offset)
                hasher.update(view)
                if sink is not None:
                    sink(offset, view)
                fetched += len(data)
            os.fsync(fd)
        finally:
            os.close(fd)
        digest = hasher.hexdigest()
        if digest != key.sha256:
            part.unlink(missing_ok=True)
            (entry / "part.json").unlink(missing_ok=True)
            raise ArtifactError(
                f"sha256 of {info.uri} is {digest}, but {key} expects {key.sha256}: the "
                "artifact in the object store is not the registered one",
                uri=info.uri, expected_sha256=key.sha256, actual_sha256=digest,
            )  # fmt: skip
        self._seal(key, info)
        seconds = time.perf_counter() - started
        log.info(
            "cache entry filled", key=str(key), uri=info.uri, size=info.size,
            fetched=fetched, resumed=resumed, seconds=round(seconds, 3),
        )  # fmt: skip
        return FillResult(entry / WEIGHTS, fetched, resumed, seconds)

    def _resume(self, entry: Path, info: ObjectInfo, hasher: Any, sink: ChunkSink | None) -> int:
        """Re-hash (and re-feed) the valid prefix of an interrupted fill; 0 to restart."""
        part, state = entry / PART, entry / "part.json"
        try:
            prior = json.loads(state.read_text())
            have = min(part.stat().st_size, info.size)
        except (FileNotFoundError, ValueError):
            prior, have = None, 0
        if not prior or prior.get("etag") != info.etag or prior.get("size") != info.size:
            # Different (or unknown) object: its bytes must never mix with the new ones.
            part.unlink(missing_ok=True)
            _write_json(state, {"uri": info.uri, "etag": info.etag, "size": info.size})
            return 0
        with part.open("rb") as fh:
            offset = 0
            while offset < have:
                chunk = fh.read(min(_HASH_CHUNK, have - offset))
                if not chunk:
                    break
                hasher.update(chunk)
                if sink is not None:
                    sink(offset, memoryview(chunk))
                offset += len(chunk)
        log.info("resuming interrupted cache fill", uri=info.uri, resumed_bytes=offset)
        return offset

    def _seal(self, key: CacheKey, info: ObjectInfo) -> None:
        entry = self.entry_dir(key)
        now = time.time()
        meta = {
            "model": key.model, "version": key.version, "sha256": key.sha256,
            "manifest": key.manifest, "size": info.size, "source_uri": info.uri,
            "etag": info.etag, "filled_at": now, "verified_at": now,
        }  # fmt: skip
        # meta first, then the weights: weights.safetensors never exists without its meta.
        _write_json(entry / "meta.json", meta)
        os.replace(entry / PART, entry / WEIGHTS)
        (entry / "part.json").unlink(missing_ok=True)
        _fsync_dir(entry)

    # --- budget and eviction -------------------------------------------------------
    def make_room(self, nbytes: int, *, keep: CacheKey | None = None) -> None:
        """Evict least-recently-used unpinned entries until ``nbytes`` more fit."""
        with self._global_lock():
            entries = self.ls()
            used = sum(e.size for e in entries if keep is None or e.key != keep)
            if used + nbytes <= self.max_bytes:
                return
            victims = sorted(
                (e for e in entries if e.key != keep and not e.pinned and not e.filling),
                key=lambda e: (e.complete, e.last_used),  # stale partial fills go first
            )
            for victim in victims:
                if self._evict_entry(victim.key):
                    used -= victim.size
                    if used + nbytes <= self.max_bytes:
                        return
        raise CacheFull(
            f"cannot fit {nbytes} bytes in the weight cache: {used} of {self.max_bytes} "
            "bytes are used by entries that are pinned or being filled",
            needed_bytes=nbytes, used_bytes=used, max_bytes=self.max_bytes,
        )  # fmt: skip

    def evict(self, model: str, version: str) -> list[CacheKey]:
        """Remove every entry of ``model:version``; ``EntryPinned`` if one is in use."""
        gone: list[CacheKey] = []
        with self._global_lock():
            for entry in self.ls():
                if (entry.key.model, entry.key.version) != (model, version):
                    continue
                if not self._evict_entry(entry.key):
                    raise EntryPinned(
                        f"{entry.key} is pinned by a live replica or being filled",
                        sha256=entry.key.sha256,
                    )
                gone.append(entry.key)
        return gone

    def _evict_entry(self, key: CacheKey) -> bool:
        entry = self.entry_dir(key)
        fill, pin = _Flock(entry / "fill.lock"), _Flock(entry / "pin.lock")
        try:
            if not (fill.try_lock(fcntl.LOCK_EX) and pin.try_lock(fcntl.LOCK_EX)):
                return False
            trash = self.root / ".trash" / uuid.uuid4().hex
            _make_dirs(trash.parent)
            os.replace(entry, trash)  # one atomic step: a pinner re-checks the inode
        finally:
            fill.close()
            pin.close()
        shutil.rmtree(trash, ignore_errors=True)
        log.info("cache entry evicted", key=str(key), sha256=key.sha256)
        return True

    def ls(self) -> list[CacheEntry]:
        """Every entry (complete or being filled), read from the file system."""
        out: list[CacheEntry] = []
        bases: list[tuple[int | None, Path]] = [(None, self.root / "v1")]
        if self.root.is_dir():
            tenants = [d for d in self.root.glob("t*") if d.name[1:].isdigit()]
            bases += [(int(d.name[1:]), d / "v1") for d in sorted(tenants)]
        for tenant, base in bases:
            try:
                entries = sorted(base.glob("*/*/*")) if base.is_dir() else []
                entries += sorted(base.glob("*/*/*/f/*")) if base.is_dir() else []
            except PermissionError:  # another tenant's directory, seen from a replica
                continue
            for entry in entries:
                found = self._describe(entry, tenant)
                if found is not None:
                    out.append(found)
        return out

    def _describe(self, entry: Path, tenant: int | None = None) -> CacheEntry | None:
        try:
            meta = json.loads((entry / "meta.json").read_text())
        except (FileNotFoundError, ValueError):
            meta = None
        weights, part = entry / WEIGHTS, entry / PART
        complete = meta is not None and weights.is_file()
        if not complete and not part.exists():
            return None  # only locks (a pin taken before a fill): nothing on disk to show
        if complete and meta is not None:
            key = CacheKey(meta["model"], meta["version"], meta["sha256"], tenant,
                           meta.get("manifest"))  # fmt: skip
            size, last_used, source = weights.stat().st_size, weights.stat().st_mtime, None
            source = meta.get("source_uri")
        else:
            try:
                state = json.loads((entry / "part.json").read_text())
            except (FileNotFoundError, ValueError):
                state = {}
            in_manifest = entry.parent.name == "f"
            version_dir = entry.parent.parent if in_manifest else entry
            try:
                key = CacheKey(unquote(version_dir.parent.parent.name),
                               unquote(version_dir.parent.name), entry.name, tenant,
                               version_dir.name if in_manifest else None)  # fmt: skip
            except LoaderError:
                return None  # not a directory this cache made
            size = int(state.get("size", 0)) if part.exists() else 0
            last_used = (part if part.exists() else entry).stat().st_mtime
            source = state.get("uri")
        return CacheEntry(
            key, entry, size, complete, last_used,
            pinned=_held(entry / "pin.lock"), filling=_held(entry / "fill.lock"),
            source_uri=source,
        )  # fmt: skip


def _links_are(tree: Path, want: dict[str, str]) -> bool:
    """Whether ``tree`` holds exactly the links ``want`` (relative path -> target)."""
    if not tree.is_dir():
        return False
    found: dict[str, str] = {}
    for top, _, files in os.walk(tree):
        for name in files:
            link = Path(top) / name
            if not link.is_symlink():
                return False
            found[link.relative_to(tree).as_posix()] = os.readlink(link)
    return found == want


def _held(path: Path) -> bool:
    """Whether someone holds a flock on ``path`` (probe with a non-blocking EX)."""
    if not path.exists():
        return False
    lock = _Flock(path)
    try:
        return not lock.try_lock(fcntl.LOCK_EX)
    finally:
        lock.close()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True))
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
