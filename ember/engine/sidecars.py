"""The small files an engine needs beside the weights (config, tokenizer), fetched from
the artifact's prefix in the object store into a directory keyed by model and version."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ember.config import Settings
from ember.engine.spec import VersionSpec
from ember.errors import InvalidInput, ObjectNotFound
from ember.loader.stores import open_store

#: What the transformers and vLLM engines look for beside ``model.safetensors``.
SIDECARS = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.txt", "vocab.json", "merges.txt", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "added_tokens.json",
)  # fmt: skip


def fetch_sidecars(
    spec: VersionSpec, settings: Settings, required: Iterable[str] = ("config.json",)
) -> Path:
    """Copy the files beside the weights into ``<cache>/sidecars/<model>/<version>/``."""
    prefix = spec.artifact_uri.rsplit("/", 1)[0]
    target = settings.weight_cache_dir / "sidecars" / spec.model / spec.version
    target.mkdir(parents=True, exist_ok=True)
    store = open_store(spec.artifact_uri, settings)
    for name in SIDECARS:
        uri = f"{prefix}/{name}"
        try:
            info = store.stat(uri)
        except ObjectNotFound:
            continue
        data = store.read_range(uri, 0, info.size, etag=info.etag)
        tmp = target / f".{name}.{os.getpid()}.part"
        tmp.write_bytes(data)
        os.replace(tmp, target / name)  # readers never see a half-written file
    for name in required:
        if not (target / name).exists():
            raise InvalidInput(
                f"no {name} beside {spec.artifact_uri}: the {spec.engine} engine needs it"
            )
    return target
