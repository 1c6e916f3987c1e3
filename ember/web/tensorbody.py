"""A binary tensor body: many instances of a tensor model as one array, no JSON.

    Content-Type: application/x-ember-tensor; dtype=float32; shape=64,256

The body is the array's bytes, row-major (C order), little-endian: exactly
``prod(shape) * itemsize`` bytes; the first dimension is the instances. The batch lane
speaks it end to end (worker → gateway ``:predict`` → replica ``/infer``): the gateway
checks it and passes the bytes on without decoding them, and the replica reads them
with ``np.frombuffer`` straight into one batch array. Priority and deadline travel as
headers (``X-Ember-Priority``, ``X-Ember-Timeout-Ms``). The answer is the usual JSON,
unless the caller sends ``Accept: application/x-ember-tensor`` and the predictions are
numbers of one shape: then it is a tensor body too (``answer_body``; the predictions as
one array, model and version in the ``X-Ember-Model`` / ``X-Ember-Version`` headers), so
neither side builds or parses a float per value.

Hostile input is a ``MalformedRequest`` (400 problem), never a crash or a large
allocation: an unknown dtype, a shape that is not a list of positive integers (rank
at most 8, at most ``max_rows`` instances), a body whose length is not what the shape
and dtype say (a truncated or padded body).

Torch-free (numpy only): the gateway, the workers and the replica all import it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.errors import MalformedRequest, PayloadTooLarge

MEDIA_TYPE = "application/x-ember-tensor"
DTYPES = ("float32", "float16", "float64", "int32", "int64")
MAX_RANK = 8
MAX_HEADER = 256
TIMEOUT_HEADER = "x-ember-timeout-ms"


def is_tensor(content_type: str | None) -> bool:
    """Whether a Content-Type names this body (parameters aside)."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == MEDIA_TYPE


@dataclass(frozen=True, slots=True)
class TensorBody:
    """A checked body: ``len(data) == prod(shape) * itemsize``, ``shape[0] >= 1``."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]

    def __len__(self) -> int:
        """Instances (rows): what admission and the router count."""
        return self.shape[0]

    @property
    def content_type(self) -> str:
        return f"{MEDIA_TYPE}; dtype={self.dtype}; shape={','.join(map(str, self.shape))}"

    def array(self) -> np.ndarray[Any, Any]:
        """The instances as one read-only array (no copy on a little-endian host)."""
        wire = np.dtype(self.dtype).newbyteorder("<")
        return np.frombuffer(self.data, dtype=wire).reshape(self.shape)

    def digest(self) -> str:
        """sha256 of dtype, shape and bytes: the cache and prediction-log input digest."""
        h = hashlib.sha256(self.content_type.encode())
        h.update(b"\n")
        h.update(self.data)
        return h.hexdigest()

    def tolist(self) -> list[Any]:
        """As JSON instances (the prediction log's payloads, when a deployment logs them)."""
        rows: list[Any] = self.array().tolist()
        return rows

    @classmethod
    def of(cls, array: np.ndarray[Any, Any]) -> TensorBody:
        """The body of ``array`` (instances along the first dimension)."""
        name = array.dtype.name
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not one of {DTYPES}")
        if array.ndim < 1 or array.shape[0] < 1:
            raise ValueError("a tensor body holds at least one instance")
        wire = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        return cls(wire.tobytes(), name, tuple(int(d) for d in array.shape))


def answer_body(predictions: list[Any]) -> TensorBody | None:
    """``predictions`` as one tensor body, the numbers JSON would carry (Python floats
    are float64, ints int64; numpy's reading, so a boolean in a row of numbers counts as
    one), or None when they are not numbers of one shape (ragged, strings, objects,
    booleans, nulls): such answers stay JSON."""
    if not predictions:
        return None
    first = predictions[0]
    if isinstance(first, bool) or not isinstance(first, (int, float, list)):
        return None  # a dict, a string, a null: not a tensor
    try:
        array = np.asarray(predictions)
    except (ValueError, OverflowError):  # ragged, or an int beyond int64
        return None
    if array.dtype.kind not in "iuf" or array.shape[0] != len(predictions):
        return None
    if array.dtype.kind == "u" or (array.dtype.kind == "i" and array.dtype != np.int64):
        return None  # only what JSON numbers map to
    return TensorBody.of(array)


def parse(content_type: str, data: bytes, max_rows: int) -> TensorBody:
    """Check a body against its Content-Type; ``MalformedRequest`` if they disagree."""
    if len(content_type) > MAX_HEADER:
        raise MalformedRequest("the tensor body's Content-Type is too long")
    media, _, rest = content_type.partition(";")
    if media.strip().lower() != MEDIA_TYPE:
        raise MalformedRequest(f"not a {MEDIA_TYPE} body")
    params: dict[str, str] = {}
    for part in rest.split(";"):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        if not sep:
            raise MalformedRequest(f"malformed Content-Type parameter {part.strip()!r}")
        params[name.strip().lower()] = value.strip().strip('"')
    dtype = params.get("dtype")
    if dtype not in DTYPES:
        raise MalformedRequest(
            f"a {MEDIA_TYPE} body needs dtype= one of {', '.join(DTYPES)} (got {dtype!r})"
        )
    shape = _shape(params.get("shape"))
    if shape[0] > max_rows:
        raise PayloadTooLarge(
            f"{shape[0]} instances in one request; at most {max_rows}", max_instances=max_rows
        )
    expected = math.prod(shape) * np.dtype(dtype).itemsize
    if len(data) != expected:
        raise MalformedRequest(
            f"the body is {len(data)} bytes; dtype {dtype} and shape {list(shape)} need {expected}",
            expected_bytes=expected,
            got_bytes=len(data),
        )
    return TensorBody(data, dtype, shape)


def _shape(text: str | None) -> tuple[int, ...]:
    if not text:
        raise MalformedRequest(f"a {MEDIA_TYPE} body needs shape=N,D1,... in its Content-Type")
    parts = text.split(",")
    if len(parts) > MAX_RANK:
        raise MalformedRequest(f"shape {text!r}: at most {MAX_RANK} dimensions")
    dims: list[int] = []
    for part in parts:
        part = part.strip()
        if not (part.isascii() and part.isdigit()) or len(part) > 9 or int(part) < 1:
            raise MalformedRequest(f"shape {text!r}: dimensions are positive integers")
        dims.append(int(part))
    return tuple(dims)


def timeout_header(value: str | None, max_ms: float) -> float | None:
    """``X-Ember-Timeout-Ms`` (a tensor body's deadline): None when absent."""
    if value is None:
        return None
    try:
        timeout_ms = float(value)
    except ValueError:
        timeout_ms = math.nan
    if not 0 < timeout_ms <= max_ms:  # NaN fails too
        raise MalformedRequest(f"{TIMEOUT_HEADER} must be a number in (0, {max_ms:g}]")
    return timeout_ms
