"""Job inputs and results in the object store.

Results are the canonical JSON ``{"predictions": [...]}``; its sha256 is the job's
``result_sha256`` whether the result is kept inline (small) or in the store (large,
under ``job-results/<tenant>/<model>/<version>/<job>/attempt-<n>.json``: each attempt
writes its own object, and the one whose fenced write lost deletes its own).

``input_uri`` objects must lie under the tenant's own prefix (``job-inputs/<tenant>/`` of
the object store, where ``ember jobs submit --input`` uploads, or ``<tenant>/`` of an extra
file root or allowed bucket; ``ember.loader.stores.tenant_prefixes``), so a tenant can
only feed a model what it put there itself; the worker reads it confined the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ember.config import Settings
from ember.errors import InvalidInput, LoaderError, PayloadTooLarge, StoreAccessDenied
from ember.loader.stores import (
    FileStore,
    ObjectInfo,
    S3Store,
    check_location,
    join_uri,
    open_store,
)


def encode_result(predictions: list[Any]) -> bytes:
    return json.dumps({"predictions": predictions}, separators=(",", ":")).encode()


def result_uri(settings: Settings, tenant: str, model: str, version: str, uid: str, n: int) -> str:
    return join_uri(result_prefix(settings, tenant, model, version, uid), f"attempt-{n}.json")


def input_prefix(settings: Settings, tenant: str) -> str:
    return join_uri(settings.store_url, "job-inputs", tenant) + "/"


def put_bytes(settings: Settings, uri: str, data: bytes) -> ObjectInfo:
    store = open_store(uri, settings)
    fd, tmp = tempfile.mkstemp(prefix="ember-job-", suffix=".json")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return store.put_file(Path(tmp), uri)
    finally:
        Path(tmp).unlink(missing_ok=True)


def read_bytes(
    settings: Settings,
    uri: str,
    max_bytes: int,
    etag: str | None = None,
    *,
    tenant: str | None = None,
) -> bytes:
    """The whole object; with ``tenant``, only if it lies under that tenant's job-input
    prefixes (``locate_input``)."""
    store = open_store(uri, settings, tenant=tenant, area="job-inputs")
    info = store.stat(uri)
    if info.size > max_bytes:
        raise PayloadTooLarge(f"{uri} is {info.size} bytes; the limit is {max_bytes}")
    return b"".join(store.iter_chunks(uri, etag=etag or info.etag))


def delete_object(settings: Settings, uri: str) -> None:
    """Remove one object (missing is fine)."""
    store = open_store(uri, settings)
    if isinstance(store, FileStore):
        store.path_of(uri).unlink(missing_ok=True)
    elif isinstance(store, S3Store):
        bucket, key = store.split(uri)
        store.client.delete_object(Bucket=bucket, Key=key)


def delete_prefix(settings: Settings, prefix: str) -> int:
    """Remove every object under ``prefix`` (a job's result folder: the result and what
    attempts that died before their fenced write left behind). Returns how many."""
    prefix = prefix.rstrip("/") + "/"
    store = open_store(prefix + "x", settings)
    removed = 0
    if isinstance(store, FileStore):
        root = store.path_of(prefix + "x").parent
        if root.is_dir():
            for path in sorted(root.rglob("*"), reverse=True):
                if path.is_file() or path.is_symlink():
                    path.unlink()
                    removed += 1
                else:
                    path.rmdir()
            root.rmdir()
    elif isinstance(store, S3Store):
        bucket, key = store.split(prefix + "x")
        pages = store.client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=key[:-1]
        )
        for page in pages:
            for obj in page.get("Contents", []):
                store.client.delete_object(Bucket=bucket, Key=obj["Key"])
                removed += 1
    return removed


def result_prefix(settings: Settings, tenant: str, model: str, version: str, uid: str) -> str:
    return join_uri(settings.store_url, "job-results", tenant, model, version, uid)


def locate_input(settings: Settings, tenant: str, uri: str) -> ObjectInfo:
    """Check that ``uri`` is the tenant's own job input and small enough; its stat.

    The location is checked before the object is looked at, so a refusal is the same
    whether or not something exists there; no answer names a server path."""
    try:
        check_location(uri, settings, tenant=tenant, area="job-inputs")
    except StoreAccessDenied as exc:
        raise InvalidInput(
            f"input_uri: {exc.detail}; upload it to job-inputs/{tenant}/ of the object "
            "store, or use `ember jobs submit --input FILE`"
        ) from exc
    try:
        info = open_store(uri, settings, tenant=tenant, area="job-inputs").stat(uri)
    except LoaderError as exc:
        raise InvalidInput(f"input_uri: {exc.detail}") from exc
    if info.size > settings.jobs_max_input_bytes:
        raise PayloadTooLarge(
            f"input_uri object is {info.size} bytes; the limit is "
            f"{settings.jobs_max_input_bytes} (EMBER_JOBS_MAX_INPUT_BYTES)"
        )
    return info


def parse_instances(data: bytes, where: str) -> list[Any]:
    """``{"instances": [...]}`` (the ``:predict`` body) from JSON bytes."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("instances"), list):
        raise InvalidInput(f'{where} must be a JSON object {{"instances": [...]}}')
    instances: list[Any] = doc["instances"]
    if not instances:
        raise InvalidInput(f"{where} has no instances")
    return instances


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
