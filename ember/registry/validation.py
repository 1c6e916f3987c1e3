"""Artifact validation at registration: defensive header read, sha256, size, tensor count.

Small artifacts validate before the API answers; large ones validate on a background
thread pool while the version is ``pending``. Pending versions are picked up again on
start, so a restart never leaves one pending forever.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

from sqlalchemy import Engine
from sqlmodel import select

from ember.config import Settings
from ember.domain.manifest import (
    MAX_SIDECAR_BYTES,
    SIDECARS,
    Manifest,
    ManifestFile,
    check_structure,
)
from ember.domain.safetensors import PREFIX_BYTES, Header, parse_header, read_header_len
from ember.errors import (
    ArtifactError,
    EmberError,
    LoaderError,
    ObjectNotFound,
    StoreAccessDenied,
)
from ember.loader.stores import ObjectInfo, ObjectStore, open_store, shown, under_tenant_prefix
from ember.logs import get_logger, model_context
from ember.registry.db import session_scope
from ember.registry.tables import Model, ModelVersion, Tenant, VersionStatus

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ArtifactFacts:
    sha256: str
    """The weights' digest; a directory version's manifest digest."""
    size_bytes: int
    tensor_count: int
    etag: str
    files: list[dict[str, Any]] | None = None
    """The manifest (``ModelVersion.files``)."""


def locate(uri: str, settings: Settings, tenant: str | None = None) -> ObjectInfo:
    """Cheap checks done before anything is stored: allowed location (with ``tenant``:
    under that tenant's own prefix, checked before the object is looked at, so a refusal
    says nothing of what exists there), object exists. A directory (a URI ending in ``/``,
    or one naming a directory or S3 prefix) is listed: its info carries the directory's
    URI, ending in ``/``, and the size of all its files."""
    store = open_store(uri, settings, tenant=tenant)
    if not uri.endswith("/"):
        try:
            return store.stat(uri)
        except ObjectNotFound:
            try:
                listing = store.list_dir(uri + "/", settings.manifest_max_files)
            except ObjectNotFound:
                raise ObjectNotFound(f"no object at {shown(uri)}") from None
            uri += "/"
    else:
        listing = store.list_dir(uri, settings.manifest_max_files)
    digest = hashlib.sha256("\0".join(f"{p}\0{i.etag}" for p, i in listing).encode())
    return ObjectInfo(uri, sum(i.size for _, i in listing), digest.hexdigest())


def inspect_artifact(
    uri: str, settings: Settings, expected_sha256: str | None, tenant: str | None = None
) -> ArtifactFacts:
    """Read the header(s) defensively and digest every byte (streamed, never in memory).
    With ``tenant``, every read is confined to that tenant's prefix, as ``locate``."""
    store = open_store(uri, settings, tenant=tenant)
    if uri.endswith("/"):
        return _inspect_directory(store, uri, settings, expected_sha256)
    info = store.stat(uri)
    header = _read_header(store, info, settings)
    sha256 = _digest(store, info)
    if expected_sha256 is not None and sha256 != expected_sha256:
        raise ArtifactError(
            f"sha256 mismatch: the artifact's digest is {sha256}, the registration said "
            f"{expected_sha256}"
        )
    files = [ManifestFile(path=_basename(uri), size=info.size, sha256=sha256)]
    base = uri.rsplit("/", 1)[0]
    for name in SIDECARS:  # what an engine reads beside the weights: verified at load
        try:
            side = store.stat(f"{base}/{name}")
        except (ObjectNotFound, StoreAccessDenied):
            continue
        if side.size > MAX_SIDECAR_BYTES:
            raise ArtifactError(f"{name} beside the weights is {side.size} bytes, more than "
                                f"{MAX_SIDECAR_BYTES}")  # fmt: skip
        files.append(ManifestFile(path=name, size=side.size, sha256=_digest(store, side)))
    return ArtifactFacts(
        sha256, info.size, len(header.tensors), info.etag, [f.model_dump() for f in files]
    )


def _basename(uri: str) -> str:
    return unquote(uri.rsplit("/", 1)[-1])


def _digest(store: ObjectStore, info: ObjectInfo) -> str:
    digest = hashlib.sha256()
    for _, part in store.iter_parts(info.uri, info):  # every part is read against info.etag
        digest.update(part)
    return digest.hexdigest()


def _read_header(store: ObjectStore, info: ObjectInfo, settings: Settings) -> Header:
    prefix = store.read_range(info.uri, 0, min(PREFIX_BYTES, info.size), etag=info.etag)
    header_len = read_header_len(prefix, info.size, settings.artifact_max_header_bytes)
    return parse_header(
        store.read_range(info.uri, PREFIX_BYTES, header_len, etag=info.etag), info.size
    )


def _inspect_directory(
    store: ObjectStore, uri: str, settings: Settings, expected: str | None
) -> ArtifactFacts:
    """A directory version: list, check the layout from the paths, every shard's header
    and the index against them, then digest every file (``ember.domain.manifest``). Each
    error names the file (and the tensor) at fault; nothing beyond the files' sizes is
    read or allocated."""
    infos, headers = _directory_structure(store, uri, settings)
    top = {p: h for p, h in headers.items() if "/" not in p}
    with ThreadPoolExecutor(4, thread_name_prefix="ember-digest") as pool:
        digests = dict(zip(infos, pool.map(lambda i: _digest(store, i), infos.values()),
                           strict=True))  # fmt: skip
    manifest = Manifest.of(
        ManifestFile(path=p, size=i.size, sha256=digests[p]) for p, i in infos.items()
    )
    if expected is not None and manifest.digest != expected:
        raise ArtifactError(
            f"sha256 mismatch: the manifest's digest is {manifest.digest}, the registration "
            f"said {expected}"
        )
    return ArtifactFacts(
        manifest.digest, manifest.size, sum(len(h.tensors) for h in top.values()),
        manifest.digest, [f.model_dump() for f in manifest.files],
    )  # fmt: skip


def check_directory(uri: str, settings: Settings, tenant: str | None = None) -> None:
    """A directory version's structure (paths, every shard's header, the index), checked
    before a large one is stored ``pending``: what is wrong with its shape is a 422 at
    once; only the digests are left to the background."""
    _directory_structure(open_store(uri, settings, tenant=tenant), uri, settings)


def _directory_structure(
    store: ObjectStore, uri: str, settings: Settings
) -> tuple[dict[str, ObjectInfo], dict[str, Header]]:
    infos = dict(store.list_dir(uri, settings.manifest_max_files))

    def index(path: str) -> bytes:
        info = infos[path]
        return store.read_range(info.uri, 0, info.size, etag=info.etag)

    headers = check_structure(
        {p: i.size for p, i in infos.items()},
        lambda path: _read_header(store, infos[path], settings),
        index,
        max_header_bytes=settings.artifact_max_header_bytes,
    )
    return infos, headers


def apply_facts(version: ModelVersion, facts: ArtifactFacts) -> None:
    version.sha256 = facts.sha256
    version.size_bytes = facts.size_bytes
    version.tensor_count = facts.tensor_count
    version.etag = facts.etag
    version.files = facts.files
    version.status = VersionStatus.ready
    version.status_reason = None
    version.validated_at = datetime.now(UTC)


class BackgroundValidator:
    """Validates large artifacts off the request path; owned by the API app."""

    def __init__(self, engine: Engine, settings: Settings, workers: int = 2) -> None:
        self.engine = engine
        self.settings = settings
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="ember-validate")

    def submit(self, version_id: int) -> Future[None]:
        return self.pool.submit(self.run, version_id)

    def resume_pending(self) -> int:
        with session_scope(self.engine) as session:
            ids = session.exec(
                select(ModelVersion.id).where(ModelVersion.status == VersionStatus.pending)
            ).all()
        for version_id in ids:
            if version_id is not None:
                self.submit(version_id)
        return len(ids)

    def run(self, version_id: int) -> None:
        with session_scope(self.engine) as session:
            version = session.get(ModelVersion, version_id)
            model = session.get(Model, version.model_id) if version else None
            if version is None or model is None or version.status is not VersionStatus.pending:
                return
            uri, expected = version.artifact_uri, version.expected_sha256
            name, ver = model.name, version.version
            tenant = session.get(Tenant, model.tenant_id)
            # A URI under its tenant's prefix is read as that tenant's (a link put there
            # since registration cannot lead out of it); one an admin registered elsewhere
            # as the admin's.
            confine = (
                tenant.name
                if tenant is not None and under_tenant_prefix(uri, self.settings, tenant.name)
                else None
            )
        with model_context(name, ver):
            try:
                facts: ArtifactFacts | None = inspect_artifact(
                    uri, self.settings, expected, confine
                )
                reason = None
            except LoaderError as exc:
                facts, reason = None, exc.detail
            except EmberError as exc:
                facts, reason = None, f"{exc.title}: {exc.detail}"
            except Exception as exc:  # the version must not stay pending on a bug
                log.exception("artifact validation crashed", uri=uri)
                facts, reason = None, f"internal error during validation: {type(exc).__name__}"
            with session_scope(self.engine) as session:
                version = session.get(ModelVersion, version_id)
                if version is None:
                    return
                if facts is not None:
                    apply_facts(version, facts)
                    log.info("artifact validated", sha256=facts.sha256, size_bytes=facts.size_bytes)
                else:
                    version.status = VersionStatus.failed
                    version.status_reason = (reason or "")[:2000]
                    log.warning("artifact validation failed", reason=reason)
                session.add(version)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
