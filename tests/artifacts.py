"""Safetensors artifacts for tests: valid ones from the real library, and hostile bytes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def write_valid(path: Path, tensors: int = 3, rows: int = 16) -> Path:
    rng = np.random.default_rng(0)
    arrays = {f"layer{i}.weight": rng.standard_normal((rows, 8)).astype(np.float32)
              for i in range(tensors)}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(arrays, str(path), metadata={"format": "np"})
    return path


def raw_artifact(header: object, data: bytes = b"", declared_len: int | None = None) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(body) if declared_len is None else declared_len
    return struct.pack("<Q", n) + body + data


def write_sharded(
    folder: Path,
    shards: dict[str, list[str]],
    *,
    index: dict[str, str] | None = None,
    total_size: int | None = None,
    rows: int = 4,
) -> dict[str, np.ndarray]:
    """A sharded checkpoint: each shard holds the named float32 tensors; the index maps
    tensor -> shard (default: the truth) as ``model.safetensors.index.json``."""
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    for shard, names in shards.items():
        part = {n: rng.standard_normal((rows, 8)).astype(np.float32) for n in names}
        save_file(part, str(folder / shard), metadata={"format": "pt"})
        arrays.update(part)
    weight_map = index if index is not None else {n: s for s, ns in shards.items() for n in ns}
    size = total_size if total_size is not None else sum(a.nbytes for a in arrays.values())
    doc = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(doc))
    (folder / "config.json").write_text('{"model_type": "test"}')
    return arrays
