"""Open Inference Protocol (KServe v2 / Triton HTTP) on the gateway, for tensor models.

    GET  /v2                                        server metadata
    GET  /v2/health/live, /v2/health/ready          unauthenticated, like /healthz
    GET  /v2/models/{name}[/versions/{v}]           metadata from the version's schemas
    GET  /v2/models/{name}[/versions/{v}]/ready
    POST /v2/models/{name}[/versions/{v}]/infer

An infer request's one input tensor is split along its first (batch) dimension into the
``instances`` of ``Gateway.predict``, so v2 takes the same path as ``:predict``
(admission, router, cache, ladder); the predictions come back as one output tensor.
Tensors travel as JSON (``data``, flat or nested, row-major) or with the binary tensor
extension: the JSON header is the first ``Inference-Header-Content-Length`` bytes of the
body and each tensor's bytes follow in order (``parameters.binary_data_size``). The body
is read by that header alone, never guessed from Content-Type (tritonclient sends none
with JSON bodies). ``Content-Encoding: gzip|deflate`` bodies are inflated within the
request size limit.

A version's input and output are described by its ``input_schema`` / ``output_schema``:
``{"shape": [256], "dtype": "float32", "name": "input"}`` (one instance's shape; ``-1``
for any size) or a JSON schema (``{"type": "string"}``, ``{"type": "array", "items":
{"type": "number"}, "minItems": 384, "maxItems": 384}``). Without one, the engine's
defaults apply (torch: FP32 of any shape; transformers embeddings: BYTES in, FP32 out).

Errors are RFC 9457 problems with the protocol's ``error`` member beside ``detail``
(``ember.api.problems.protocol_error``); protocol violations are 400, as in Triton.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Header, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import text

import ember
from ember.api.bodies import parse_object
from ember.api.deps import PrincipalDep
from ember.api.problems import DATA_PLANE_RESPONSES, problem_responses
from ember.api.routes.predict import gateway_of, set_prediction_headers
from ember.engine.spec import Priority
from ember.errors import (
    EngineError,
    InvalidInput,
    MalformedRequest,
    NotFound,
    NotReady,
    PayloadTooLarge,
)
from ember.pools.controller import DeploymentView
from ember.pools.gateway import Gateway
from ember.registry.schemas import NAME_PATTERN, VERSION_PATTERN

router = APIRouter(tags=["kserve-v2"], responses=DATA_PLANE_RESPONSES)
ModelName = Annotated[str, Path(pattern=NAME_PATTERN, description="Model (or deployment).")]
VersionRef = Annotated[str, Path(pattern=VERSION_PATTERN, description="Version.")]
PriorityHeader = Annotated[
    str | None, Header(max_length=16, description="online (default) | async | batch")
]
SessionHeader = Annotated[str | None, Header(max_length=256)]

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


class ProtocolMismatch(InvalidInput):
    """The model exists but this protocol cannot serve it (an LLM on v2, a tensor model
    on OpenAI's routes)."""

    status = 400
    code = "protocol-mismatch"
    title = "Not served by this protocol"


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


def model_io(spec: dict[str, Any], deployment: str) -> tuple[TensorSpec, TensorSpec]:
    engine = spec.get("engine")
    task = (spec.get("engine_config") or {}).get("task", "embedding")
    if engine == "vllm" or (engine == "transformers" and task != "embedding"):
        hint = " (it generates text: use /openai/v1)" if engine == "vllm" else ""
        raise ProtocolMismatch(
            f"deployment {deployment!r} ({engine}) does not serve tensors{hint}",
            engine=engine,
        )
    if engine == "transformers":
        inputs = tensor_spec(spec.get("input_schema"), "input", BYTES, ())
        return inputs, tensor_spec(spec.get("output_schema"), "output", "FP32", (-1,))
    inputs = tensor_spec(spec.get("input_schema"), "input", "FP32")
    return inputs, tensor_spec(spec.get("output_schema"), "output", "FP32")


def _resolve(gateway: Gateway, tenant_id: int, name: str, version: str | None) -> tuple[
    DeploymentView, str, dict[str, Any]
]:  # fmt: skip
    """The deployment and the version whose schema applies (pinned, else production)."""
    view = gateway.deployment_for(tenant_id, name)
    if version is not None:
        if version not in view.specs:
            raise NotFound(f"version {version!r} of {name!r} is not served", version=version)
        return view, version, view.specs[version]
    chosen = view.production or min(view.specs, default=None)
    if chosen is None:
        raise NotReady(f"deployment {view.name!r} serves no ready version yet")
    return view, chosen, view.specs[chosen]


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


def _inflate(raw: bytes, encoding: str | None, limit: int) -> bytes:
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


def _wants_binary(request: InferRequest, names: set[str]) -> bool:
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


def _timeout_ms(request: InferRequest, view: DeploymentView) -> float:
    micros = request.parameters.get("timeout")
    if micros is None:
        return float(view.policy.timeout_ms)
    if not isinstance(micros, int | float) or isinstance(micros, bool) or not micros > 0:
        raise MalformedRequest("parameters.timeout must be a positive number of microseconds")
    return min(float(micros) / 1000, MAX_TIMEOUT_MS)


def _priority(header: str | None) -> Priority:
    try:
        return Priority.requested(header)
    except ValueError as exc:
        raise MalformedRequest(str(exc)) from None


# --- routes --------------------------------------------------------------------------------


@router.get("/v2", summary="Server metadata", response_model=ServerMetadata)
def server_metadata() -> ServerMetadata:
    return ServerMetadata(name="ember", version=ember.__version__,
                          extensions=["binary_tensor_data"])  # fmt: skip


@router.get("/v2/health/live", summary="Liveness (unauthenticated)")
def live() -> dict[str, bool]:
    return {"live": True}


@router.get(
    "/v2/health/ready",
    summary="Readiness: the registry answers and the gateway runs (unauthenticated)",
    responses=problem_responses((503, "Not ready")),
)
def ready(request: Request) -> dict[str, bool]:
    try:
        with request.app.state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        raise NotReady(f"the registry does not answer: {type(exc).__name__}") from None
    gateway_of(request)  # NotReady without a pools controller
    return {"ready": True}


def _metadata(request: Request, tenant_id: int, name: str, version: str | None) -> ModelMetadata:
    view, _, spec = _resolve(gateway_of(request), tenant_id, name, version)
    inputs, outputs = model_io(spec, view.name)
    return ModelMetadata(
        name=name,
        versions=[version] if version else sorted(view.specs),
        platform=f"ember_{spec.get('engine')}",
        inputs=[TensorMetadata(**inputs.public())],
        outputs=[TensorMetadata(**outputs.public())],
    )


@router.get("/v2/models/{name}", summary="Model metadata (the production version's)")
def model_metadata(name: ModelName, request: Request, principal: PrincipalDep) -> ModelMetadata:
    return _metadata(request, principal.tenant_id, name, None)


@router.get("/v2/models/{name}/versions/{version}", summary="Model version metadata")
def version_metadata(
    name: ModelName, version: VersionRef, request: Request, principal: PrincipalDep
) -> ModelMetadata:
    return _metadata(request, principal.tenant_id, name, version)


def _ready(request: Request, tenant_id: int, name: str, version: str | None) -> dict[str, Any]:
    gateway = gateway_of(request)
    view = _resolve(gateway, tenant_id, name, version)[0]
    key = (view.tenant_id, view.name)
    if version is None:
        gateway.controller.routable_traffic(view)  # NotReady (503) when nothing serves
    elif not gateway.controller.routes(key, version):
        raise NotReady(f"version {version!r} of {name!r} has no ready replica", version=version)
    return {"name": name, "ready": True}


@router.get("/v2/models/{name}/ready", summary="Model readiness (503 when not ready)")
def model_ready(name: ModelName, request: Request, principal: PrincipalDep) -> dict[str, Any]:
    return _ready(request, principal.tenant_id, name, None)


@router.get("/v2/models/{name}/versions/{version}/ready", summary="Model version readiness")
def version_ready(
    name: ModelName, version: VersionRef, request: Request, principal: PrincipalDep
) -> dict[str, Any]:
    return _ready(request, principal.tenant_id, name, version)


INFER_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": InferRequest.model_json_schema()},
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "The binary tensor extension: the JSON header "
                "(Inference-Header-Content-Length bytes) followed by tensor data.",
            },
        },
    },
}
INFER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Outputs as JSON, or the JSON header and binary tensor data "
        "(Inference-Header-Content-Length says where the header ends).",
        "model": InferResponse,
        "content": {"application/octet-stream": {}},
    },
    **problem_responses((400, "Protocol violation: bad datatype, shape, binary section")),
}


async def _infer(
    request: Request,
    principal: Any,
    name: str,
    version: str | None,
    priority_header: str | None,
    session_key: str | None,
) -> Response:
    gateway = gateway_of(request)
    limit = request.app.state.settings.max_request_bytes
    body = _inflate(await request.body(), request.headers.get("content-encoding"), limit)
    infer, binary = parse_request(body, request.headers.get(HEADER_LENGTH))
    view, chosen, spec = _resolve(gateway, principal.tenant_id, name, version)
    in_spec, out_spec = model_io(spec, view.name)
    if len(infer.inputs) != 1 or infer.inputs[0].name != in_spec.name:
        given = [t.name for t in infer.inputs]
        raise MalformedRequest(f"the model takes one input named {in_spec.name!r} (got {given})")
    tensor = infer.inputs[0]
    array, end = decode_input(tensor, binary, 0)
    if end != len(binary):
        raise MalformedRequest(f"{len(binary) - end} bytes follow the last tensor's data")
    instances = to_instances(array, tensor, in_spec)
    outputs = {model_io(s, view.name)[1].name for s in view.specs.values()} | {out_spec.name}
    binary_out = _wants_binary(infer, outputs)
    timeout_ms = _timeout_ms(infer, view)
    result = await gateway.predict(
        view, principal.tenant, instances, _priority(priority_header), timeout_ms, session_key,
        version,
    )  # fmt: skip
    if result.version != chosen and result.version in view.specs:
        out_spec = model_io(view.specs[result.version], view.name)[1]
    output = to_output(result.body["predictions"], out_spec)
    described: dict[str, Any] = {"name": out_spec.name, "datatype": out_spec.datatype,
                                 "shape": list(output.shape)}  # fmt: skip
    answer: dict[str, Any] = {"model_name": name, "model_version": result.version}
    if infer.id is not None:
        answer["id"] = infer.id
    if binary_out:
        data = _output_bytes(output, out_spec.datatype)
        answer["outputs"] = [described | {"parameters": {"binary_data_size": len(data)}}]
        head = json.dumps(answer).encode()
        response = Response(head + data, media_type="application/octet-stream")
        response.headers["Inference-Header-Content-Length"] = str(len(head))
    else:
        flat = [s.decode() if isinstance(s, bytes) else s for s in output.flatten().tolist()]
        answer["outputs"] = [described | {"data": flat}]
        try:
            raw = json.dumps(answer, allow_nan=False).encode()
        except ValueError:
            raise EngineError("the model's output holds NaN or infinity") from None
        response = Response(raw, media_type="application/json")
    set_prediction_headers(response, result)
    return response


@router.post(
    "/v2/models/{name}/infer",
    summary="Infer (JSON or binary tensors)",
    openapi_extra=INFER_DOC,
    responses=INFER_RESPONSES,
    response_model=None,
)
async def infer(
    name: ModelName,
    request: Request,
    principal: PrincipalDep,
    x_ember_priority: PriorityHeader = None,
    x_ember_session: SessionHeader = None,
) -> Response:
    """Routed by the deployment's traffic weights, like `:predict`."""
    return await _infer(request, principal, name, None, x_ember_priority, x_ember_session)


@router.post(
    "/v2/models/{name}/versions/{version}/infer",
    summary="Infer with one version",
    openapi_extra=INFER_DOC,
    responses=INFER_RESPONSES,
    response_model=None,
)
async def infer_version(
    name: ModelName,
    version: VersionRef,
    request: Request,
    principal: PrincipalDep,
    x_ember_priority: PriorityHeader = None,
    x_ember_session: SessionHeader = None,
) -> Response:
    return await _infer(request, principal, name, version, x_ember_priority, x_ember_session)
