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
