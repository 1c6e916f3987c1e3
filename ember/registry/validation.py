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

from sqlalchemy import Engine
from sqlmodel import select

from ember.config import Settings
from ember.errors import ArtifactError, EmberError, LoaderError
from ember.loader.safetensors import PREFIX_BYTES, parse_header, read_header_len
from ember.loader.stores import ObjectInfo, open_store, under_tenant_prefix
from ember.logs import get_logger, model_context
from ember.registry.db import session_scope
from ember.registry.tables import Model, ModelVersion, Tenant, VersionStatus

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ArtifactFacts:
    sha256: str
    size_bytes: int
    tensor_count: int
    etag: str


def locate(uri: str, settings: Settings, tenant: str | None = None) -> ObjectInfo:
    """Cheap checks done before anything is stored: allowed location (with ``tenant``:
    under that tenant's own prefix, checked before the object is looked at, so a refusal
    says nothing of what exists there), object exists."""
    return open_store(uri, settings, tenant=tenant).stat(uri)


def inspect_artifact(
    uri: str, settings: Settings, expected_sha256: str | None, tenant: str | None = None
) -> ArtifactFacts:
    """Read the header defensively and digest the whole object (streamed, never in memory).
    With ``tenant``, every read is confined to that tenant's prefix, as ``locate``."""
    store = open_store(uri, settings, tenant=tenant)
    info = store.stat(uri)
    prefix = store.read_range(uri, 0, min(PREFIX_BYTES, info.size), etag=info.etag)
    header_len = read_header_len(prefix, info.size, settings.artifact_max_header_bytes)
    header = parse_header(
        store.read_range(uri, PREFIX_BYTES, header_len, etag=info.etag), info.size
    )
    digest = hashlib.sha256()
    for _, part in store.iter_parts(uri, info):  # every part is read against info.etag
        digest.update(part)
    sha256 = digest.hexdigest()
    if expected_sha256 is not None and sha256 != expected_sha256:
        raise ArtifactError(
            f"sha256 mismatch: the artifact's digest is {sha256}, the registration said "
            f"{expected_sha256}"
        )
    return ArtifactFacts(sha256, info.size, len(header.tensors), info.etag)


def apply_facts(version: ModelVersion, facts: ArtifactFacts) -> None:
    version.sha256 = facts.sha256
    version.size_bytes = facts.size_bytes
    version.tensor_count = facts.tensor_count
    version.etag = facts.etag
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
