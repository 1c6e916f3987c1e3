"""The Open Inference Protocol's (KServe v2 / Triton HTTP) wire format: reading an infer
request's tensors and writing the answer's, with no HTTP framework in sight.

The routes (``ember.api.routes.v2``) read the body, resolve the deployment and call the
gateway; everything between the bytes and the instances ``Gateway.predict`` takes (and
back) is here, so it can be read, and tested, as plain functions.

Tensors travel as JSON (``data``, flat or nested, row-major) or with the binary tensor
extension: the JSON header is the first ``Inference-Header-Content-Length`` bytes of the
body and each tensor's bytes follow in order (``parameters.binary_data_size``). The body
is read by that header alone, never guessed from Content-Type (tritonclient sends none
with JSON bodies). ``Content-Encoding: gzip|deflate`` bodies are inflated within the
request size limit (``inflate``).

A version's input and output are described by its ``input_schema`` / ``output_schema``:
``{"shape": [256], "dtype": "float32", "name": "input"}`` (one instance's shape; ``-1``
for any size) or a JSON schema (``{"type": "string"}``, ``{"type": "array", "items":
{"type": "number"}, "minItems": 384, "maxItems": 384}``). Without one, the engine's
defaults apply (torch: FP32 of any shape; transformers embeddings: BYTES in, FP32 out):
``model_io``.

Every protocol violation is a ``MalformedRequest`` (400, as in Triton); an answer the
model gave that is no tensor of its output's datatype is an ``EngineError``.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ember.api.protocols.common import ProtocolMismatch
from ember.domain.spec import VersionSpec
from ember.errors import EngineError, MalformedRequest, PayloadTooLarge
from ember.web.bodies import parse_object

HEADER_LENGTH = "inference-header-content-length"
MAX_ROWS = 10_000
MAX_TIMEOUT_MS = 600_000.0
#: v2 datatypes → numpy (little-endian on the wire); BYTES is length-prefixed strings.
NUMPY = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32",
         "UINT64": "uint64", "INT8": "int8", "INT16": "int16", "INT32": "int32",
         "INT64": "int64", "FP16": "float16", "FP32": "float32", "FP64": "float64"}  # fmt: skip
BYTES = "BYTES"
DATATYPES = (*NUMPY, BYTES)
FROM_NUMPY = {v: k for k, v in NUMPY.items()}
JSON_TYPES = {"string": BYTES, "number": "FP32", "integer": "INT64", "boolean": "BOOL"}


# --- what a version takes and gives --------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...] | None
    """One instance's shape (``-1``: any size); None when the schema does not say."""

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": [-1, *(self.shape or ())]}


def _datatype(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    if value.upper() in DATATYPES:
        return value.upper()
    return FROM_NUMPY.get(value.lower())


def _shape(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list) or len(value) > 32:
        return None
    if all(isinstance(d, int) and not isinstance(d, bool) and d >= -1 for d in value):
        return tuple(value)
    return None


def _json_schema(schema: Any, depth: int = 0) -> tuple[str, tuple[int, ...]] | None:
    if depth > 16 or not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str) and kind in JSON_TYPES:
        return JSON_TYPES[kind], ()
    if kind == "array":
        inner = _json_schema(schema.get("items"), depth + 1)
        if inner is None:
            return None
        low, high = schema.get("minItems"), schema.get("maxItems")
        size = low if isinstance(low, int) and low == high and low >= 0 else -1
        return inner[0], (size, *inner[1])
    return None


def tensor_spec(
    schema: Any, name: str, datatype: str, shape: tuple[int, ...] | None = None
) -> TensorSpec:
    """A version's input or output tensor from its schema (defaults: the engine's)."""
    if not isinstance(schema, dict):
        return TensorSpec(name, datatype, shape)
    given = schema.get("name")
    if isinstance(given, str) and 0 < len(given) <= 256:
        name = given
    if {"shape", "dtype", "datatype"} & schema.keys():
        declared = _datatype(schema.get("datatype") or schema.get("dtype"))
        return TensorSpec(name, declared or datatype, _shape(schema.get("shape")))
    parsed = _json_schema(schema)
    return TensorSpec(name, *parsed) if parsed else TensorSpec(name, datatype, shape)


def model_io(spec: VersionSpec, deployment: str) -> tuple[TensorSpec, TensorSpec]:
    """The version's input and output tensors; ``ProtocolMismatch`` for a model that
    does not take tensors (an LLM, a transformers task other than embedding)."""
    engine = spec.engine
    task = spec.engine_config.get("task", "embedding")
    if engine == "vllm" or (engine == "transformers" and task != "embedding"):
        hint = " (it generates text: use /openai/v1)" if engine == "vllm" else ""
        raise ProtocolMismatch(
            f"deployment {deployment!r} ({engine}) does not serve tensors{hint}",
            engine=engine,
        )
    if engine == "transformers":
        inputs = tensor_spec(spec.input_schema, "input", BYTES, ())
        return inputs, tensor_spec(spec.output_schema, "output", "FP32", (-1,))
    inputs = tensor_spec(spec.input_schema, "input", "FP32")
    return inputs, tensor_spec(spec.output_schema, "output", "FP32")


# --- wire schemas (documentation and validation of the JSON header) ------------------------


class InputTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=256)
    shape: list[Annotated[int, Field(ge=0, le=2**40)]] = Field(max_length=32)
    datatype: str = Field(max_length=16)
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: list[Any] | None = None


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=256)
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferRequest(BaseModel):
    """The JSON header of an infer request (KServe v2)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, max_length=256)
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[InputTensor] = Field(min_length=1, max_length=64)
    outputs: list[RequestedOutput] | None = Field(None, max_length=64)


class OutputTensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[OutputTensor]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


# --- reading a request ---------------------------------------------------------------------


def inflate(raw: bytes, encoding: str | None, limit: int) -> bytes:
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return raw
    if encoding not in ("gzip", "deflate"):
        raise MalformedRequest(f"Content-Encoding {encoding!r} is not supported (gzip, deflate)")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        body = inflater.decompress(raw, limit + 1)
    except zlib.error as exc:
        raise MalformedRequest(f"the {encoding} body does not inflate: {exc}") from None
    if len(body) > limit:
        raise PayloadTooLarge(f"the inflated request body exceeds the {limit}-byte limit")
    if not inflater.eof:
        raise MalformedRequest(f"the {encoding} body is truncated")
    return body


def _split(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary section after it."""
    if header_length is None:
        return body, memoryview(b"")
    value = header_length.strip()
    if not value.isdigit() or len(value) > 12:
        raise MalformedRequest(f"Inference-Header-Content-Length {value!r} is not a byte count")
    size = int(value)
    if size > len(body):
        raise MalformedRequest(
            f"Inference-Header-Content-Length is {size} but the body has {len(body)} bytes"
        )
    return body[:size], memoryview(body)[size:]


def parse_request(body: bytes, header_length: str | None) -> tuple[InferRequest, memoryview]:
    head, binary = _split(body, header_length)
    if not head.strip():
        raise MalformedRequest("the request has no JSON inference header")
    infer, _ = parse_object(bytes(head), InferRequest, "the inference header")
    return infer, binary


def _read_bytes_elements(raw: memoryview, count: int, name: str) -> list[bytes]:
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise MalformedRequest(f"input {name!r}: BYTES element length is truncated")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise MalformedRequest(f"input {name!r}: BYTES element runs past its data")
        items.append(bytes(raw[offset : offset + length]))
        offset += length
        if len(items) > count:
            break
    if len(items) != count:
        raise MalformedRequest(
            f"input {name!r} has {len(items)} BYTES elements, its shape needs {count}"
        )
    return items


def _flatten(data: Any, depth: int = 0) -> list[Any]:
    if depth > 32:
        raise MalformedRequest("tensor data is nested deeper than 32 levels")
    if not isinstance(data, list):
        return [data]
    if not any(isinstance(item, list) for item in data):
        return data
    flat: list[Any] = []
    for item in data:
        flat.extend(_flatten(item, depth + 1) if isinstance(item, list) else [item])
    return flat


def decode_input(
    tensor: InputTensor, binary: memoryview, offset: int
) -> tuple[np.ndarray[Any, Any], int]:
    """The tensor as an array of its shape (BYTES: an object array of ``bytes``), and the
    offset after its binary data."""
    name, datatype = tensor.name, tensor.datatype
    if datatype not in DATATYPES:
        supported = ", ".join(DATATYPES)
        raise MalformedRequest(f"input {name!r}: datatype {datatype!r} is not one of {supported}")
    if "shared_memory_region" in tensor.parameters:
        raise MalformedRequest(f"input {name!r}: shared memory is not supported over HTTP")
    count = math.prod(tensor.shape)
    size = tensor.parameters.get("binary_data_size")
    if size is not None:
        if tensor.data is not None:
            raise MalformedRequest(f"input {name!r} has both data and binary_data_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise MalformedRequest(f"input {name!r}: binary_data_size must be a byte count")
        if offset + size > len(binary):
            raise MalformedRequest(
                f"input {name!r}: binary_data_size {size} runs past the body "
                f"({len(binary) - offset} bytes left): the binary section is truncated"
            )
        raw = binary[offset : offset + size]
        if datatype == BYTES:
            items = _read_bytes_elements(raw, count, name)
            array = np.empty(count, dtype=object)
            array[:] = items
            return array.reshape(tensor.shape), offset + size
        dtype = np.dtype(NUMPY[datatype]).newbyteorder("<")
        if size != count * dtype.itemsize:
            raise MalformedRequest(
                f"input {name!r}: {size} bytes of {datatype} do not make shape {tensor.shape} "
                f"({count * dtype.itemsize} bytes)"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(tensor.shape), offset + size
    if tensor.data is None:
        raise MalformedRequest(f"input {name!r} has neither data nor binary_data_size")
    if datatype == BYTES:
        flat = _flatten(tensor.data)
        if len(flat) != count:
            raise MalformedRequest(
                f"input {name!r} has {len(flat)} elements, its shape {tensor.shape} needs {count}"
            )
        if not all(isinstance(x, str) for x in flat):
            raise MalformedRequest(f"input {name!r}: BYTES data must be strings")
        array = np.empty(count, dtype=object)
        array[:] = [x.encode() for x in flat]
        return array.reshape(tensor.shape), offset
    try:  # flat or nested (row-major); numpy parses it in C
        values = np.asarray(tensor.data)
    except (TypeError, ValueError) as exc:
        raise MalformedRequest(f"input {name!r}: data is not a rectangular array: {exc}") from None
    if values.dtype.kind not in "biuf":
        raise MalformedRequest(
            f"input {name!r}: {datatype} data must be numbers (within the datatype's range)"
        )
    if values.size != count:
        raise MalformedRequest(
            f"input {name!r} has {values.size} elements, its shape {tensor.shape} needs {count}"
        )
    return _cast(values, datatype, name).reshape(tensor.shape), offset


def _cast(values: np.ndarray[Any, Any], datatype: str, name: str) -> np.ndarray[Any, Any]:
    target = np.dtype(NUMPY[datatype])
    if target.kind in "iu" and values.size:
        if values.dtype.kind == "f":
            raise MalformedRequest(f"input {name!r}: {datatype} data must be integers")
        info = np.iinfo(target)
        if values.min() < info.min or values.max() > info.max:
            raise MalformedRequest(f"input {name!r}: a value is out of the {datatype} range")
    return values.astype(target)


def to_instances(array: np.ndarray[Any, Any], tensor: InputTensor, spec: TensorSpec) -> list[Any]:
    """Rows of the batch, checked against the version's input."""
    shape = tuple(tensor.shape)
    expected = [-1, *spec.shape] if spec.shape is not None else None
    if tensor.datatype != spec.datatype:
        raise MalformedRequest(
            f"input {tensor.name!r} has datatype {tensor.datatype}, the model takes {spec.datatype}"
        )
    if not shape or shape[0] == 0:
        raise MalformedRequest(f"input {tensor.name!r} needs a batch dimension of at least 1")
    if shape[0] > MAX_ROWS:
        raise MalformedRequest(f"input {tensor.name!r} has {shape[0]} rows; at most {MAX_ROWS}")
    row = shape[1:]
    if spec.shape == () and row == (1,):  # [N, 1] for one value per instance, as Triton does
        array, row = array.reshape(shape[0]), ()
    fits = spec.shape is None or (
        len(row) == len(spec.shape)
        and all(e in (-1, g) for e, g in zip(spec.shape, row, strict=True))
    )
    if not fits:
        raise MalformedRequest(
            f"input {tensor.name!r} has shape {list(shape)}, the model takes {expected}"
        )
    if spec.datatype == BYTES:
        try:
            texts = np.vectorize(lambda b: b.decode(), otypes=[object])(array)
        except UnicodeDecodeError:
            raise MalformedRequest(f"input {tensor.name!r}: BYTES are not UTF-8 text") from None
        return list(texts.tolist())
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise MalformedRequest(f"input {tensor.name!r} holds NaN or infinity")
    return list(array.tolist())


# --- writing a response --------------------------------------------------------------------


def to_output(predictions: list[Any], spec: TensorSpec) -> np.ndarray[Any, Any]:
    if spec.datatype == BYTES:
        if not all(isinstance(x, str) for x in predictions):
            raise EngineError(f"the model's output is not text ({spec.name!r} is BYTES)")
        array = np.empty(len(predictions), dtype=object)
        array[:] = predictions
        return array
    try:
        array = np.asarray(predictions, dtype=NUMPY[spec.datatype])
    except (TypeError, ValueError, OverflowError) as exc:
        raise EngineError(f"the model's output is not a {spec.datatype} tensor: {exc}") from None
    return array


def _output_bytes(array: np.ndarray[Any, Any], datatype: str) -> bytes:
    if datatype == BYTES:
        parts = [s.encode() for s in array.flat]
        return b"".join(struct.pack("<I", len(p)) + p for p in parts)
    little = array.astype(np.dtype(NUMPY[datatype]).newbyteorder("<"), copy=False)
    return bytes(np.ascontiguousarray(little).tobytes())


def wants_binary(request: InferRequest, names: set[str]) -> bool:
    """Whether the output goes as binary data; requested names are checked against the
    outputs of the versions the deployment serves (a canary may name its output apart)."""
    default = request.parameters.get("binary_data_output", False)
    if not isinstance(default, bool):
        raise MalformedRequest("parameters.binary_data_output must be true or false")
    if request.outputs is None:
        return default
    binary = default
    for out in request.outputs:
        if out.name not in names:
            raise MalformedRequest(f"unknown output {out.name!r}: the model has {sorted(names)}")
        if "classification" in out.parameters:
            raise MalformedRequest("the classification extension is not supported")
        if "shared_memory_region" in out.parameters:
            raise MalformedRequest("shared memory is not supported over HTTP")
        binary = out.parameters.get("binary_data", default)
        if not isinstance(binary, bool):
            raise MalformedRequest(f"output {out.name!r}: binary_data must be true or false")
    return binary


def timeout_ms(request: InferRequest, default_ms: float) -> float:
    """The request's deadline (``parameters.timeout``, microseconds) in milliseconds,
    capped at ``MAX_TIMEOUT_MS``; ``default_ms`` (the deployment's) when it names none."""
    micros = request.parameters.get("timeout")
    if micros is None:
        return default_ms
    if not isinstance(micros, int | float) or isinstance(micros, bool) or not micros > 0:
        raise MalformedRequest("parameters.timeout must be a positive number of microseconds")
    return min(float(micros) / 1000, MAX_TIMEOUT_MS)


def read_instances(request: InferRequest, binary: memoryview, spec: TensorSpec) -> list[Any]:
    """The instances of the request's one input (named as ``spec``): its tensor split
    along the batch dimension, the binary section read to its last byte."""
    if len(request.inputs) != 1 or request.inputs[0].name != spec.name:
        given = [t.name for t in request.inputs]
        raise MalformedRequest(f"the model takes one input named {spec.name!r} (got {given})")
    tensor = request.inputs[0]
    array, end = decode_input(tensor, binary, 0)
    if end != len(binary):
        raise MalformedRequest(f"{len(binary) - end} bytes follow the last tensor's data")
    return to_instances(array, tensor, spec)


@dataclass(frozen=True)
class Encoded:
    """An infer response's body: JSON, or the JSON header and the binary tensor data."""

    content: bytes
    media_type: str
    header_length: int | None = None
    """``Inference-Header-Content-Length`` (binary responses only)."""


def encode_response(
    predictions: list[Any],
    spec: TensorSpec,
    *,
    model_name: str,
    model_version: str,
    request_id: str | None,
    binary: bool,
) -> Encoded:
    """The predictions as the response's one output tensor (``spec``)."""
    output = to_output(predictions, spec)
    described: dict[str, Any] = {"name": spec.name, "datatype": spec.datatype,
                                 "shape": list(output.shape)}  # fmt: skip
    answer: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        answer["id"] = request_id
    if binary:
        data = _output_bytes(output, spec.datatype)
        answer["outputs"] = [described | {"parameters": {"binary_data_size": len(data)}}]
        head = json.dumps(answer).encode()
        return Encoded(head + data, "application/octet-stream", len(head))
    flat = [s.decode() if isinstance(s, bytes) else s for s in output.flatten().tolist()]
    answer["outputs"] = [described | {"data": flat}]
    try:
        raw = json.dumps(answer, allow_nan=False).encode()
    except ValueError:
        raise EngineError("the model's output holds NaN or infinity") from None
    return Encoded(raw, "application/json")
