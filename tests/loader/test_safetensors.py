"""Defensive header parsing (hypothesis) and round trips against safetensors itself."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.config import Settings
from ember.domain.safetensors import DTYPE_BITS, PREFIX_BYTES, parse_header, read_header_len
from ember.errors import ArtifactError
from ember.loader.load import load_file, read_header

torch = pytest.importorskip("torch")
from safetensors.torch import _TYPES, save_file  # noqa: E402

MAX_HEADER = 64 * 1024

dims = st.lists(st.one_of(st.integers(0, 8), st.integers(0, 2**64)), max_size=4)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from([*DTYPE_BITS, "F128", "", "bf16"]) | json_values,
        "shape": dims | json_values,
        "data_offsets": st.lists(st.integers(-4, 2**64), min_size=0, max_size=3) | json_values,
    }
)
headers = st.dictionaries(st.text(max_size=6), entries | json_values, max_size=5)


def _check(header_bytes: bytes, file_size: int) -> None:
    tracemalloc.start()
    try:
        parsed = parse_header(header_bytes, file_size)
    except ArtifactError as exc:
        assert str(exc)  # says what is wrong
        return
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        # Never an allocation proportional to what the header *claims*: bounded by input.
        assert peak < 64 * len(header_bytes) + 256 * 1024
    assert sum(t.nbytes for t in parsed.tensors) == parsed.data_len <= file_size


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers, st.integers(0, 4096))
def test_fuzzed_structured_headers_never_crash(header: dict, data_len: int) -> None:  # type: ignore[type-arg]
    raw = json.dumps(header).encode()
    _check(raw, PREFIX_BYTES + len(raw) + data_len)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.integers(0, 2**20))
def test_fuzzed_raw_bytes_never_crash(raw: bytes, data_len: int) -> None:
    _check(raw, PREFIX_BYTES + len(raw) + data_len)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=16), st.integers(0, 2**40))
def test_length_prefix_is_bounded_before_reading(prefix: bytes, file_size: int) -> None:
    try:
        n = read_header_len(prefix, file_size, MAX_HEADER)
    except ArtifactError:
        return
    assert 0 < n <= MAX_HEADER and PREFIX_BYTES + n <= file_size


def test_mutated_real_file_never_crashes_the_loader(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    save_file({"a": torch.ones(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, str(path))
    good = path.read_bytes()
    cfg = Settings(data_dir=tmp_path)
    for i in range(0, len(good), 3):
        for bad in (good[:i], good[:i] + bytes([good[i] ^ 0xFF]) + good[i + 1 :]):
            path.write_bytes(bad)
            try:
                read_header(path, cfg.artifact_max_header_bytes)
                loaded = load_file(path, settings=cfg)
            except ArtifactError:
                continue
            assert set(loaded.tensors) <= {"a", "b"}  # only data bytes were flipped


def test_huge_declared_shape_is_refused_without_allocating() -> None:
    header = {"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}}
    with pytest.raises(ArtifactError, match="larger than"):
        _check_raise(json.dumps(header).encode(), 16)


def _check_raise(raw: bytes, data_len: int) -> None:
    parse_header(raw, PREFIX_BYTES + len(raw) + data_len)


def _sample(name: str, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(len(name))
    raw = torch.randint(0, 256, (3 * 5 * 7 * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(3, 5, 7)
    return raw.view(dtype).reshape(3, 5, 7)


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("into", [False, True])
def test_round_trip_every_safetensors_dtype(tmp_path: Path, direct_io: bool, into: bool) -> None:
    tensors = {
        f"{name}.{i}": _sample(name, dt)[: i + 1] for name, dt in _TYPES.items() for i in range(2)
    }
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    tensors["empty"] = torch.empty(0, 2, dtype=torch.float16)
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path))
    cfg = Settings(data_dir=tmp_path, loader_direct_io=direct_io, loader_chunk_bytes=1024**2)
    dest = {k: torch.empty_like(v) for k, v in tensors.items()} if into else None
    loaded = load_file(path, settings=cfg, into=dest)
    assert set(loaded.tensors) == set(tensors)
    for name, ref in tensors.items():
        got = loaded.tensors[name]
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8))
        if dest is not None:
            assert got.data_ptr() == dest[name].data_ptr()
    assert loaded.report.bytes == sum(t.nbytes for t in tensors.values())


def test_prefix_struct() -> None:
    assert struct.calcsize("<Q") == PREFIX_BYTES
