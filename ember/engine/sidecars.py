"""The small files an engine needs beside the weights (config, tokenizer), as a directory.

A directory version's come from its manifest: each file an entry of the weight cache,
filled and verified like a shard, the directory made of links to them
(``WeightLoader.files_dir``). A single-file version's were recorded beside the weights at
registration (``VersionSpec.files``): each is fetched into
``<cache>/sidecars/<model>/<version>/<sha256>/`` and kept only if its size and sha256 are
the registered ones; a file not in the manifest is not the version's and is not fetched.
Only a version registered before manifests (``files`` is None) has its sidecars read
unverified from beside the weights, with a warning.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from ember.config import Settings
from ember.domain.manifest import SIDECARS
from ember.domain.spec import VersionSpec
from ember.errors import ArtifactError, InvalidInput, ObjectNotFound
from ember.loader.stores import join_uri, open_store
from ember.logs import get_logger

log = get_logger(__name__)

__all__ = ["SIDECARS", "fetch_sidecars"]


def fetch_sidecars(
    spec: VersionSpec, settings: Settings, required: Iterable[str] = ("config.json",)
) -> Path:
    """The directory holding ``spec``'s files beside its weights (each verified)."""
    if spec.directory:
        from ember.engine.weights import loader_for

        target = loader_for(settings).files_dir(spec)
    else:
        target = _single_file_sidecars(spec, settings)
    for name in required:
        if not (target / name).exists():
            where = "in the version's directory" if spec.directory else "beside the weights"
            raise InvalidInput(f"no {name} {where}: the {spec.engine} engine needs it")
    return target


def _single_file_sidecars(spec: VersionSpec, settings: Settings) -> Path:
    prefix = spec.artifact_uri.rsplit("/", 1)[0]
    target = settings.weight_cache_dir / "sidecars" / spec.model / spec.version / spec.sha256
    target.mkdir(parents=True, exist_ok=True)
    store = open_store(spec.artifact_uri, settings)
    registered = {f.path: f for f in spec.files or ()}
    if spec.files is None:
        log.warning(
            "version registered before manifests: its sidecars are read unverified",
            sha256=spec.sha256,
        )
    for name in SIDECARS:
        expected = registered.get(name)
        if spec.files is not None and expected is None:
            (target / name).unlink(missing_ok=True)
            continue  # not registered with the version: not its file
        path = target / name
        if expected is not None and path.exists() and path.stat().st_size == expected.size:
            continue  # fetched and verified before (the directory is keyed by the sha256)
        uri = join_uri(prefix, name)
        try:
            info = store.stat(uri)
        except ObjectNotFound:
            if expected is not None:
                raise ArtifactError(
                    f"{name}, registered with the version, is gone from the store", file=name
                ) from None
            continue
        data = store.read_range(uri, 0, info.size, etag=info.etag)
        if expected is not None and (
            len(data) != expected.size or hashlib.sha256(data).hexdigest() != expected.sha256
        ):
            raise ArtifactError(
                f"{name} in the store is not the one registered with the version (size or "
                "sha256 differs): the version's files changed",
                file=name,
            )
        tmp = target / f".{name}.{os.getpid()}.part"
        tmp.write_bytes(data)
        os.replace(tmp, path)  # readers never see a half-written file
    return target
