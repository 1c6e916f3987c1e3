"""Where ``ember models import-hf`` takes a model from, and which of its files it keeps.

Nothing here reaches a hub: the model is already on this machine, as

- a ``save_pretrained`` directory (``config.json``, tokenizer files, safetensors);
- a Hugging Face hub cache entry, ``models--org--name/``: ``refs/<ref>`` holds a commit,
  ``snapshots/<commit>/`` the files as links into the entry's own ``blobs/``. The revision
  is ``refs/main``'s (or ``--revision``: a ref name or a commit); a link that leads
  anywhere but that ``blobs/`` is refused, never followed;
- a snapshot directory ``…/snapshots/<commit>/`` of such an entry;
- a repo id ``org/name``, looked up in the local cache: ``HF_HUB_CACHE``, else
  ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub`` (``~/.cache/…``).

Which files (``select``): the safetensors weights the index lists (a top-level
``*.safetensors`` it does not list, e.g. Mistral's ``consolidated.safetensors``, is left out;
without an index, the one top-level ``.safetensors`` or ``model.safetensors``), and the
config, tokenizer, generation and chat-template files (``*.json``, ``*.txt``, ``*.model``,
``*.jinja``, ``*.tiktoken``) plus README and licence files. Left out, each with its reason:
pickles (``.bin``, ``.pt``, ``.pth``, ``.ckpt``, ``.pkl``: unpickling runs arbitrary code, so
Ember never takes one — a repository whose only weights are pickles is refused), Python
files (a repository's own code: Ember never runs it), safetensors below the top level
(``original/``: not the version's weights), and every other format.

Torch-free, and free of ``huggingface_hub``: the cache's layout is read directly.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.domain.manifest import INDEX_SUFFIX, SIDECARS, is_index, is_shard
from ember.errors import ArtifactError, InvalidInput, ObjectNotFound
from ember.loader.upload import LocalFile, list_directory

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
TEXT_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".md")
LICENCE_PREFIXES = ("LICENSE", "LICENCE", "NOTICE", "USE_POLICY", "COPYING")
MAX_JSON_BYTES = 64 * 1024 * 1024
"""Largest config or index parsed to choose files (the registry bounds indices again)."""
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
REF = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}){0,3}")
PICKLE_WHY = (
    "a pickle: unpickling it can run arbitrary code, so Ember takes safetensors weights only"
)


@dataclass(frozen=True, slots=True)
class Source:
    root: Path
    """The directory whose files the version takes (a snapshot, or the directory)."""
    blobs: Path | None
    """A cache entry's ``blobs/``: the only place its links may lead."""
    label: str
    """What to call it in messages: ``org/name@<commit>`` or the directory."""


@dataclass
class Selection:
    files: list[LocalFile]
    left_out: list[tuple[str, str]] = field(default_factory=list)
    """``(path, why)`` of every file not taken."""
    config: dict[str, Any] | None = None
    """``config.json``, parsed."""


def hub_cache() -> Path:
    """The local hub cache, where ``huggingface_hub`` puts it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "huggingface" / "hub"


def locate(spec: str, revision: str | None = None) -> Source:
    """The model ``spec`` names: a directory (plain, a cache entry, a snapshot) or a repo
    id in the local cache. ``InvalidInput`` / ``ObjectNotFound`` say what was looked for."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InvalidInput(f"{spec} is not a directory (push a single file with `models push`)")
        real = Path(os.path.realpath(path))
        if (real / "snapshots").is_dir():
            return _from_cache(real, revision, _repo_of(real) or str(path))
        if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
            if revision is not None:
                raise InvalidInput(
                    "--revision names a revision of a cache entry, not of a snapshot"
                )
            entry = real.parent.parent
            return Source(real, entry / "blobs", f"{_repo_of(entry) or entry.name}@{real.name}")
        if revision is not None:
            raise InvalidInput("--revision applies to a Hugging Face cache entry, not a directory")
        return Source(real, None, str(path))
    if not REPO_ID.fullmatch(spec) or ".." in spec or "--" in spec:
        raise InvalidInput(f"{spec!r} is neither a directory nor a repo id (org/name)")
    cache = hub_cache()
    entry = cache / ("models--" + spec.replace("/", "--"))
    if not (entry / "snapshots").is_dir():
        raise ObjectNotFound(
            f"{spec} is not in the local Hugging Face cache ({cache}); download it there first "
            f"(`huggingface-cli download {spec}`): Ember never reaches a hub itself"
        )
    return _from_cache(Path(os.path.realpath(entry)), revision, spec)


def _repo_of(entry: Path) -> str | None:
    name = entry.name
    return name.removeprefix("models--").replace("--", "/") if name.startswith("models--") else None


def _from_cache(entry: Path, revision: str | None, label: str) -> Source:
    rev = revision or "main"
    if not REF.fullmatch(rev) or any(p in (".", "..") for p in rev.split("/")):
        raise InvalidInput(f"--revision {rev[:80]!r} is not a ref name or a commit")
    snapshots = entry / "snapshots"
    commit: str | None = None
    ref = entry / "refs" / rev
    if ref.is_file() and not ref.is_symlink():
        with ref.open("rb") as fh:
            commit = fh.read(256).decode("utf-8", "replace").strip()
    elif (snapshots / rev).is_dir():
        commit = rev
    elif revision is None:
        present = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
        if len(present) != 1:
            raise ObjectNotFound(
                f"{label}: no refs/main, and {len(present)} snapshots ({', '.join(present)}): "
                "say which with --revision"
            )
        commit = present[0]
    if commit is None:
        refs = (
            sorted(p.name for p in (entry / "refs").glob("*")) if (entry / "refs").is_dir() else []
        )
        raise ObjectNotFound(
            f"{label}: no ref or snapshot {rev!r} in the cache (refs: {', '.join(refs) or 'none'})"
        )
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", commit):
        raise ArtifactError(f"{label}: refs/{rev} does not hold a commit")
    snapshot = snapshots / commit
    real = Path(os.path.realpath(snapshot))
    if real.parent != Path(os.path.realpath(snapshots)) or not real.is_dir():
        raise ObjectNotFound(f"{label}: refs/{rev} names {commit}, which has no snapshot here")
    return Source(real, entry / "blobs", f"{label}@{commit[:12]}")


def files_of(source: Source, max_files: int) -> list[LocalFile]:
    """Every file of the source, links resolved (into the cache's ``blobs/`` only)."""
    if source.blobs is None:
        return list_directory(source.root, max_files=max_files)
    return list_directory(
        source.root,
        max_files=max_files,
        allowed=[source.blobs],
        allowed_name="the cache entry's blobs/",
    )


def select(files: list[LocalFile], label: str) -> Selection:
    """The files a version takes and those left out (see the module docstring)."""
    top = {f.path: f for f in files if "/" not in f.path}
    index = _choose_index(top, label)
    weights = _weights(top, index, label)
    chosen = Selection(files=[])
    for f in files:
        why = _left_out_because(f.path, weights, index)
        if why is None:
            chosen.files.append(f)
        else:
            chosen.left_out.append((f.path, why))
    if not weights:
        pickles = [p for p, why in chosen.left_out if why == PICKLE_WHY]
        raise ArtifactError(
            f"{label} has no safetensors weights"
            + (f"; its weights are pickles ({', '.join(pickles[:4])}), which Ember refuses: "
               "unpickling runs arbitrary code. Convert them to safetensors first (e.g. "
               "`model.save_pretrained(dir, safe_serialization=True)` where you trust them)"
               if pickles else "")
        )  # fmt: skip
    config = top.get("config.json")
    chosen.config = _json(config, label) if config is not None else None
    return chosen


def _choose_index(top: dict[str, LocalFile], label: str) -> str | None:
    indices = sorted(p for p in top if is_index(p))
    if len(indices) <= 1:
        return indices[0] if indices else None
    if f"model{INDEX_SUFFIX}" in indices:
        return f"model{INDEX_SUFFIX}"
    raise ArtifactError(f"{label} has {len(indices)} safetensors indices ({', '.join(indices)}) "
                        "and none is model.safetensors.index.json: which weights?")  # fmt: skip


def _weights(top: dict[str, LocalFile], index: str | None, label: str) -> set[str]:
    """The top-level shards the version's weights are."""
    if index is None:
        shards = sorted(p for p in top if is_shard(p))
        if len(shards) <= 1:
            return set(shards)
        if "model.safetensors" in shards:
            return {"model.safetensors"}
        raise ArtifactError(f"{label} has {len(shards)} top-level .safetensors files and no "
                            f"*{INDEX_SUFFIX} saying which are the weights")  # fmt: skip
    doc = _json(top[index], label)
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ArtifactError(f"{index}: no weight_map object of tensor name -> shard file")
    listed = {v for v in weight_map.values() if isinstance(v, str)}
    missing = sorted(s for s in listed if s not in top)
    if missing:
        raise ArtifactError(
            f"{index} lists {', '.join(s[:120] for s in missing[:4])}, not in {label} "
            "(an incomplete download?)"
        )
    return listed


def _left_out_because(path: str, weights: set[str], index: str | None) -> str | None:
    name = path.rsplit("/", 1)[-1]
    lower = name.lower()
    if lower.endswith(PICKLE_SUFFIXES):
        return PICKLE_WHY
    if lower.endswith(".py"):
        return "Python code of the repository: Ember never runs a model's own code"
    if is_shard(path):
        if "/" in path:
            return "safetensors below the top level are not the version's weights"
        if path not in weights:
            return (f"not in {index}: not one of the version's weights" if index
                    else "not model.safetensors: not the version's weights")  # fmt: skip
        return None
    if is_index(path) and path != index:
        return f"another index: the version's weights are those {index} lists"
    if (
        lower.endswith(TEXT_SUFFIXES)
        or name in SIDECARS
        or name.upper().startswith(LICENCE_PREFIXES)
    ):
        return None
    return "not a file Ember's engines read (config, tokenizer, safetensors)"


def _json(f: LocalFile, label: str) -> dict[str, Any]:
    if f.size > MAX_JSON_BYTES:
        raise ArtifactError(f"{f.path} of {label}: {f.size} bytes, more than {MAX_JSON_BYTES}")
    try:
        doc = json.loads(f.source.read_bytes())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ArtifactError(f"{f.path} of {label}: not JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise ArtifactError(f"{f.path} of {label}: not a JSON object")
    return doc


def default_engine(config: dict[str, Any] | None) -> tuple[str, dict[str, Any], str]:
    """``(engine, engine_config, why)`` from ``config.json``'s ``architectures``: vLLM for
    a causal LM, the transformers engine (classification or embedding) otherwise."""
    if config is None:
        raise InvalidInput("no config.json: say which engine with --engine")
    raw = config.get("architectures")
    names = [a for a in raw if isinstance(a, str)] if isinstance(raw, list) else []
    shown = ", ".join(names[:3]) or "none"
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in names):
        return "vllm", {}, f"config.json's architectures ({shown}): a causal LM"
    if any(a.endswith("ForSequenceClassification") for a in names):
        return "transformers", {"task": "classification"}, f"architectures ({shown}): a classifier"
    return "transformers", {}, f"architectures ({shown}): not a causal LM, served as embeddings"
