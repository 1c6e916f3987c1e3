"""A model version as a manifest of files: every file of a checkpoint directory with its
size and sha256, and the checks a sharded safetensors checkpoint must pass.

A directory version (``artifact_uri`` ending in ``/``) is identified by the **manifest's
digest** (``Manifest.digest``: the sha256 of its canonical JSON, paths sorted), which is the
version's ``sha256`` in the registry and the key of every cache entry of its files. Nothing
is read at load that is not in the manifest, and every byte read is checked against it.

What a directory may hold (``check_path``): relative paths of at most ``MAX_DEPTH``
components, each a plain name (no ``.``, ``..``, empty, backslash, control character or
``%``-escape), no hidden file or directory (``.gitattributes``, ``.cache/`` from a hub
download are skipped when listing). Its weights are the ``*.safetensors`` files at the top
level (``Manifest.shards``); with more than one, exactly one top-level index
(``*.safetensors.index.json``, Hugging Face's ``{"weight_map": {tensor: shard}}``) must list
exactly those shards, and ``check_index`` proves it against their headers: every tensor the
index names is in the shard it says, every tensor of every shard is in the index, no tensor
is in two shards, and ``metadata.total_size`` (when given) is the bytes of all tensors.
Safetensors files in subdirectories (``original/``, a diffusers component) travel with the
version and have their headers checked, but are not its weights.

Torch-free: the registry, the CLI and the loader import it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ember.domain.safetensors import Header
from ember.errors import ArtifactError

#: The files beside a single ``.safetensors`` artifact that a version takes with it
#: (recorded with their sha256 at registration): what the transformers and vLLM engines read.
SIDECARS = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.txt", "vocab.json", "merges.txt", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "added_tokens.json", "preprocessor_config.json",
)  # fmt: skip
MAX_SIDECAR_BYTES = 256 * 1024 * 1024
"""Largest sidecar a single-file version takes with it (a tokenizer is a few MB)."""
INDEX_SUFFIX = ".safetensors.index.json"
SHARD_SUFFIX = ".safetensors"
MAX_DEPTH = 4
MAX_PATH_CHARS = 512
MANIFEST_FORMAT = 1
_COMPONENT = re.compile(r"[^\x00-\x1f\x7f/\\%]+")


class ManifestFile(BaseModel):
    """One file of a version: its path inside the version's directory, size and sha256."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


def check_path(path: str) -> str:
    """``path`` if it is a relative file path a manifest may hold, else ``ArtifactError``."""
    parts = path.split("/")
    if not path or len(path) > MAX_PATH_CHARS or len(parts) > MAX_DEPTH:
        raise ArtifactError(
            f"file path {path[:80]!r}: at most {MAX_DEPTH} components and "
            f"{MAX_PATH_CHARS} characters"
        )
    for part in parts:
        if part in ("", ".", "..") or not _COMPONENT.fullmatch(part):
            raise ArtifactError(
                f"file path {path[:80]!r} is not a plain relative path inside the version's "
                "directory (no '..', '.', empty part, backslash, '%' or control character)"
            )
    return path


def hidden(path: str) -> bool:
    """Whether a listed path is skipped: a hidden file or one inside a hidden directory."""
    return any(part.startswith(".") for part in path.split("/"))


def is_shard(path: str) -> bool:
    return path.endswith(SHARD_SUFFIX)


def is_index(path: str) -> bool:
    return path.endswith(INDEX_SUFFIX)


class Manifest(BaseModel):
    """The files of one directory version, sorted by path (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    files: tuple[ManifestFile, ...]

    @classmethod
    def of(cls, files: Iterable[ManifestFile | Mapping[str, Any]]) -> Manifest:
        """Checked and sorted: paths valid and unique, at least one file."""
        parsed = [
            f if isinstance(f, ManifestFile) else ManifestFile.model_validate(f) for f in files
        ]
        seen: set[str] = set()
        for f in parsed:
            check_path(f.path)
            if f.path in seen:
                raise ArtifactError(f"file {f.path!r} is listed twice")
            seen.add(f.path)
        for f in parsed:  # a file cannot also be a directory ("a" and "a/b")
            parent = f.path.rsplit("/", 1)[0] if "/" in f.path else None
            while parent:
                if parent in seen:
                    raise ArtifactError(f"{parent!r} is both a file and a directory")
                parent = parent.rsplit("/", 1)[0] if "/" in parent else None
        if not parsed:
            raise ArtifactError("the version's directory holds no file")
        return cls(files=tuple(sorted(parsed, key=lambda f: f.path)))

    def canonical(self) -> bytes:
        body = {"format": MANIFEST_FORMAT, "files": [f.model_dump() for f in self.files]}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        """The version's identity: sha256 of the canonical JSON."""
        return hashlib.sha256(self.canonical()).hexdigest()

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @cached_property
    def files_by_path(self) -> dict[str, ManifestFile]:
        return {f.path: f for f in self.files}

    @property
    def shards(self) -> list[ManifestFile]:
        """The version's weights: the top-level ``*.safetensors`` files."""
        return [f for f in self.files if "/" not in f.path and is_shard(f.path)]

    @property
    def index(self) -> ManifestFile | None:
        """The top-level index (``check_layout`` guarantees at most one)."""
        found = [f for f in self.files if "/" not in f.path and is_index(f.path)]
        return found[0] if found else None

    def check_layout(self) -> None:
        """What can be checked from the paths alone: weights present, index where needed."""
        shards = self.shards
        indices = [f for f in self.files if "/" not in f.path and is_index(f.path)]
        if len(indices) > 1:
            raise ArtifactError(
                f"more than one top-level safetensors index: {', '.join(f.path for f in indices)}"
            )
        if not shards:
            raise ArtifactError("no top-level .safetensors file: the version has no weights")
        if len(shards) > 1 and not indices:
            raise ArtifactError(
                f"{len(shards)} top-level .safetensors files and no *{INDEX_SUFFIX} saying "
                "which tensor is in which"
            )


def max_index_bytes(headers: Mapping[str, Header], limit: int) -> int:
    """The largest index worth parsing for these shards: an entry per tensor, each at most
    a tensor name (bounded by its header entry) plus a shard name and punctuation. An index
    larger than that names tensors no shard holds, so it is refused before it is parsed (a
    10^6-entry index beside a small checkpoint never becomes 10^6 Python objects)."""
    tensors = sum(len(h.tensors) for h in headers.values())
    names = max((len(p) for p in headers), default=0)
    header_bytes = sum(h.header_len for h in headers.values())
    return min(limit, 4096 + header_bytes + tensors * (names + 16))


def check_index(
    index_path: str,
    raw: bytes,
    headers: Mapping[str, Header],
    *,
    limit: int,
) -> dict[str, str]:
    """Prove the index ``raw`` (at ``index_path``) agrees with the shards' ``headers``
    (path -> parsed header, every top-level shard of the manifest); returns the weight map.
    Every error names the file and, where there is one, the tensor."""
    bound = max_index_bytes(headers, limit)
    if len(raw) > bound:
        raise ArtifactError(
            f"{index_path}: {len(raw)} bytes, more than an index of these "
            f"{sum(len(h.tensors) for h in headers.values())} tensors can need ({bound})"
        )
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ArtifactError(f"{index_path}: not a JSON document ({type(exc).__name__})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ArtifactError(f"{index_path}: no weight_map object of tensor name -> shard file")
    where: dict[str, str] = {}  # tensor -> shard, from the headers
    for shard, header in headers.items():
        for spec in header.tensors:
            other = where.get(spec.name)
            if other is not None:
                raise ArtifactError(
                    f"tensor {spec.name!r} is in two shards: {other} and {shard}",
                    tensor=spec.name[:200],
                    files=[other, shard],
                )
            where[spec.name] = shard
    listed: set[str] = set()
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ArtifactError(f"{index_path}: tensor {tensor[:200]!r} maps to a non-string")
        if "/" in shard or shard in (".", "..") or "\\" in shard or not is_shard(shard):
            raise ArtifactError(
                f"{index_path}: tensor {tensor[:200]!r} points at {shard[:200]!r}, which is not "
                "a .safetensors file beside the index",
                tensor=tensor[:200],
            )
        if shard not in headers:
            raise ArtifactError(
                f"{index_path}: tensor {tensor[:200]!r} is in shard {shard[:200]!r}, which the "
                "version does not have",
                tensor=tensor[:200],
                file=shard[:200],
            )
        actual = where.get(tensor)
        if actual != shard:
            raise ArtifactError(
                f"{index_path}: tensor {tensor[:200]!r} should be in {shard}, but "
                + (f"it is in {actual}" if actual else f"{shard} does not hold it"),
                tensor=tensor[:200],
                file=shard,
            )
        listed.add(shard)
    for shard in headers:
        if shard not in listed:
            raise ArtifactError(f"shard {shard} is not listed in {index_path}", file=shard)
    for tensor, shard in where.items():
        if tensor not in weight_map:
            raise ArtifactError(
                f"tensor {tensor[:200]!r} of {shard} is not in {index_path}",
                tensor=tensor[:200],
                file=shard,
            )
    meta = doc.get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    if isinstance(total, int) and not isinstance(total, bool):
        data = sum(h.data_len for h in headers.values())
        if total != data:
            raise ArtifactError(
                f"{index_path}: metadata.total_size is {total} bytes, but the shards' tensors "
                f"are {data} bytes"
            )
    return {str(k): str(v) for k, v in weight_map.items()}


def check_structure(
    sizes: Mapping[str, int],
    read_header: Callable[[str], Header],
    read_index: Callable[[str], bytes],
    *,
    max_header_bytes: int,
) -> dict[str, Header]:
    """A directory's checks before its digests (the registry's on the store, ``ember
    models push``'s on local files): the layout from the paths (``sizes``: path -> size),
    every safetensors header (``read_header``, defensive), every index against the shards
    beside it (``read_index``, called only for an index no larger than those shards could
    need). Returns the headers by path; each error names the file (and the tensor)."""
    for path in sizes:
        check_path(path)
    Manifest.of(ManifestFile(path=p, size=n, sha256="0" * 64) for p, n in sizes.items()
                ).check_layout()  # fmt: skip
    headers: dict[str, Header] = {}
    for path in sizes:
        if is_shard(path):
            try:
                headers[path] = read_header(path)
            except ArtifactError as exc:
                extra = {**exc.extra, "file": path}
                raise ArtifactError(f"{path}: {exc.detail}", **extra) from None
    for path, size in sizes.items():
        if not is_index(path):
            continue
        folder = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
        shards = {p.removeprefix(folder): h for p, h in headers.items()
                  if p.startswith(folder) and "/" not in p.removeprefix(folder)}  # fmt: skip
        bound = max_index_bytes(shards, max_header_bytes)
        if size > bound:  # refused before a byte of it is read
            raise ArtifactError(
                f"{path}: {size} bytes, more than an index of these "
                f"{sum(len(h.tensors) for h in shards.values())} tensors can need ({bound})",
                file=path,
            )
        check_index(path, read_index(path), shards, limit=max_header_bytes)
    return headers
