"""Open Inference Protocol (KServe v2 / Triton HTTP) on the gateway, for tensor models.

    GET  /v2                                        server metadata
    GET  /v2/health/live, /v2/health/ready          unauthenticated, like /healthz
    GET  /v2/models/{name}[/versions/{v}]           metadata from the version's schemas
    GET  /v2/models/{name}[/versions/{v}]/ready
    POST /v2/models/{name}[/versions/{v}]/infer

The routes only: the wire format (JSON and binary tensors, a version's input and output
tensors) is ``ember.api.protocols.oip``. An infer request's one input tensor is split
along its first (batch) dimension into the ``instances`` of ``Gateway.predict``, so v2
takes the same path as ``:predict`` (admission, router, cache, ladder); the predictions
come back as one output tensor. Every route but the health probes authenticates with
``PrincipalDep``, as every data-plane route does.

Errors are RFC 9457 problems with the protocol's ``error`` member beside ``detail``
(``ember.web.problems.protocol_error``); protocol violations are 400, as in Triton.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Request, Response
from sqlalchemy import text

import ember
from ember.api.deps import PrincipalDep
from ember.api.protocols import oip
from ember.api.protocols.common import requested_priority
from ember.api.protocols.oip import InferRequest, ModelMetadata, ServerMetadata, TensorMetadata
from ember.api.routes.predict import gateway_of, set_prediction_headers
from ember.domain.spec import VersionSpec
from ember.errors import NotFound, NotReady
from ember.registry.schemas import NAME_PATTERN, VERSION_PATTERN
from ember.registry.tenants import Principal
from ember.serving.gateway import Gateway
from ember.serving.routing import DeploymentView
from ember.web.problems import DATA_PLANE_RESPONSES, problem_responses

router = APIRouter(tags=["kserve-v2"], responses=DATA_PLANE_RESPONSES)
ModelName = Annotated[str, Path(pattern=NAME_PATTERN, description="Model (or deployment).")]
VersionRef = Annotated[str, Path(pattern=VERSION_PATTERN, description="Version.")]
PriorityHeader = Annotated[
    str | None, Header(max_length=16, description="online (default) | async | batch")
]
SessionHeader = Annotated[str | None, Header(max_length=256)]


def _resolve(gateway: Gateway, tenant_id: int, name: str, version: str | None) -> tuple[
    DeploymentView, str, VersionSpec
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
    inputs, outputs = oip.model_io(spec, view.name)
    return ModelMetadata(
        name=name,
        versions=[version] if version else sorted(view.specs),
        platform=f"ember_{spec.engine}",
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
        gateway.control.routable_traffic(view)  # NotReady (503) when nothing serves
    elif not gateway.control.table.routes(key, version):
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
        "model": oip.InferResponse,
        "content": {"application/octet-stream": {}},
    },
    **problem_responses((400, "Protocol violation: bad datatype, shape, binary section")),
}


async def _infer(
    request: Request,
    principal: Principal,
    name: str,
    version: str | None,
    priority_header: str | None,
    session_key: str | None,
) -> Response:
    gateway = gateway_of(request)
    limit = request.app.state.settings.max_request_bytes
    body = oip.inflate(await request.body(), request.headers.get("content-encoding"), limit)
    infer, binary = oip.parse_request(body, request.headers.get(oip.HEADER_LENGTH))
    view, chosen, spec = _resolve(gateway, principal.tenant_id, name, version)
    in_spec, out_spec = oip.model_io(spec, view.name)
    instances = oip.read_instances(infer, binary, in_spec)
    outputs = {oip.model_io(s, view.name)[1].name for s in view.specs.values()} | {out_spec.name}
    binary_out = oip.wants_binary(infer, outputs)
    timeout_ms = oip.timeout_ms(infer, float(view.policy.timeout_ms))
    result = await gateway.predict(
        view, principal.tenant, instances, requested_priority(priority_header), timeout_ms,
        session_key, version,
    )  # fmt: skip
    if result.version != chosen and result.version in view.specs:
        out_spec = oip.model_io(view.specs[result.version], view.name)[1]
    encoded = oip.encode_response(
        result.body["predictions"], out_spec, model_name=name, model_version=result.version,
        request_id=infer.id, binary=binary_out,
    )  # fmt: skip
    response = Response(encoded.content, media_type=encoded.media_type)
    if encoded.header_length is not None:
        response.headers["Inference-Header-Content-Length"] = str(encoded.header_length)
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
