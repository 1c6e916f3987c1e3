"""Defensive safetensors header parsing.

Layout: ``u64 little-endian N`` | ``N bytes of UTF-8 JSON`` | data section. The header is
hostile until proven otherwise: its length is bounded before anything is allocated, every
dtype must be known, every shape must match its byte range, and the byte ranges must tile
the data section exactly (in order, no gaps, no overlap). Anything else is an
``ArtifactError`` that says what is wrong — never a crash or an allocation larger than
the file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

from ember.errors import ArtifactError

PREFIX_BYTES = 8

#: dtype -> size in bits, as the safetensors format defines them.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    """Offset of the first byte, relative to the start of the data section."""
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class Header:
    header_len: int
    """Length of the JSON header (N)."""
    data_len: int
    tensors: tuple[TensorSpec, ...]
    """Ordered by offset."""
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_offset(self) -> int:
        return PREFIX_BYTES + self.header_len

    @property
    def file_size(self) -> int:
        return self.data_offset + self.data_len


def read_header_len(prefix: bytes, file_size: int, max_header_bytes: int) -> int:
    """Validate the 8-byte prefix against the real file size before reading the header."""
    if file_size < PREFIX_BYTES or len(prefix) < PREFIX_BYTES:
        raise ArtifactError(
            f"not a safetensors file: {file_size} bytes is shorter than the 8-byte header length"
        )
    (header_len,) = struct.unpack("<Q", prefix[:PREFIX_BYTES])
    if header_len == 0:
        raise ArtifactError("not a safetensors file: header length is 0")
    if header_len > max_header_bytes:
        raise ArtifactError(
            f"safetensors header declares {header_len} bytes, more than the "
            f"{max_header_bytes}-byte limit"
        )
    if PREFIX_BYTES + header_len > file_size:
        raise ArtifactError(
            f"truncated safetensors file: header declares {header_len} bytes but the file "
            f"has only {file_size - PREFIX_BYTES} after the length prefix"
        )
    return int(header_len)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ArtifactError(f"safetensors header has duplicate key {key!r}")
        out[key] = value
    return out


def parse_header(header_bytes: bytes, file_size: int) -> Header:
    """Parse and validate the JSON header of a file of ``file_size`` bytes."""
    header_len = len(header_bytes)
    data_len = file_size - PREFIX_BYTES - header_len
    if data_len < 0:
        raise ArtifactError("truncated safetensors file: header runs past the end of the file")
    try:
        text = header_bytes.decode("utf-8")
        raw = json.loads(text, object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as exc:
        raise ArtifactError(f"safetensors header is not UTF-8: {exc.reason}") from exc
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"safetensors header is not valid JSON: {exc.msg}") from exc
    except RecursionError as exc:
        raise ArtifactError("safetensors header JSON is nested too deeply") from exc
    if not isinstance(raw, dict):
        raise ArtifactError(f"safetensors header must be a JSON object, got {type(raw).__name__}")
    metadata = _metadata(raw.pop("__metadata__", {}))
    tensors = sorted(
        (_tensor(name, entry, data_len) for name, entry in raw.items()),
        key=lambda t: (t.begin, t.end),
    )
    _check_tiling(tensors, data_len)
    return Header(header_len, data_len, tuple(tensors), metadata)


def _metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ArtifactError("safetensors __metadata__ must be an object of string to string")
    return value


def _tensor(name: str, entry: Any, data_len: int) -> TensorSpec:
    where = f"tensor {name!r}"
    if not isinstance(entry, dict):
        raise ArtifactError(f"{where}: entry must be an object")
    unknown = set(entry) - {"dtype", "shape", "data_offsets"}
    if unknown:
        raise ArtifactError(f"{where}: unknown field(s) {sorted(unknown)}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise ArtifactError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise ArtifactError(f"{where}: shape must be a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o) for o in offsets):
        raise ArtifactError(f"{where}: data_offsets must be two non-negative integers")
    begin, end = offsets
    if begin > end:
        raise ArtifactError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
    if end > data_len:
        raise ArtifactError(
            f"{where}: data_offsets [{begin}, {end}] out of range (data section is "
            f"{data_len} bytes)"
        )
    numel = 0 if 0 in shape else 1
    for dim in shape:
        numel *= dim
        if numel > 2**64:  # bounded arithmetic: a hostile shape cannot make us multiply forever
            raise ArtifactError(f"{where}: shape {shape[:8]}... is larger than any file")
    bits = numel * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        raise ArtifactError(
            f"{where}: shape {shape} of {dtype} needs {bits / 8:g} bytes but data_offsets "
            f"span {end - begin}"
        )
    return TensorSpec(name, dtype, tuple(shape), begin, end)


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tiling(tensors: list[TensorSpec], data_len: int) -> None:
    cursor = 0
    for t in tensors:
        if t.begin < cursor:
            raise ArtifactError(f"tensor {t.name!r}: data_offsets overlap the previous tensor")
        if t.begin > cursor:
            raise ArtifactError(
                f"tensor {t.name!r}: gap of {t.begin - cursor} bytes before its data"
            )
        cursor = t.end
    if cursor != data_len:
        raise ArtifactError(
            f"data section is {data_len} bytes but tensors cover {cursor}: "
            + ("truncated file" if cursor > data_len else "trailing bytes after the last tensor")
        )
