"""Online predict (KServe V1 / TF Serving body) and a deployment's replicas."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from ember.api.deps import PrincipalDep, SessionDep
from ember.api.problems import DATA_PLANE_RESPONSES
from ember.engine.spec import Priority
from ember.errors import InvalidInput, NotReady
from ember.pools.gateway import Gateway, Prediction
from ember.registry import deployments
from ember.registry.schemas import NAME_PATTERN, VERSION_PATTERN

router = APIRouter(tags=["predict"], responses=DATA_PLANE_RESPONSES)
ModelName = Annotated[str, Path(pattern=NAME_PATTERN, description="Model name.")]
VersionRef = Annotated[str, Path(pattern=VERSION_PATTERN, description="Version.")]


class PredictRequest(BaseModel):
    """``{"instances": [...]}`` → ``{"predictions": [...]}`` (KServe V1, TF Serving)."""

    model_config = ConfigDict(extra="forbid")

    instances: list[Any] = Field(min_length=1, max_length=10_000)
    timeout_ms: float | None = Field(None, gt=0, le=600_000, description="Deadline.")
    priority: str = Field("online", description="online | async | batch")


class PredictResponse(BaseModel):
    predictions: list[Any]
    model: str
    version: str


def set_prediction_headers(response: Response, result: Prediction) -> None:
    """Every data-plane answer says which deployment, version, replica and ladder rung
    served it (every protocol route calls this)."""
    response.headers["X-Ember-Deployment"] = result.deployment
    response.headers["X-Ember-Version"] = result.version
    response.headers["X-Ember-Replica"] = result.replica_id
    response.headers["X-Ember-Attempts"] = str(result.attempts)
    response.headers["X-Ember-Rung"] = result.rung
    response.headers["X-Ember-Cache"] = result.cache


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway | None = getattr(request.app.state, "gateway", None)
    if gateway is None:
        raise NotReady("this API process runs no pools controller (EMBER_POOLS_ENABLED=false)")
    return gateway


async def _predict(
    request: Request,
    response: Response,
    principal: Any,
    name: str,
    body: PredictRequest,
    version: str | None,
    session_key: str | None,
) -> PredictResponse | Response:
    gateway = gateway_of(request)
    try:
        priority = Priority.requested(body.priority)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc
    view = gateway.deployment_for(principal.tenant_id, name)
    timeout_ms = body.timeout_ms or float(view.policy.timeout_ms)
    result = await gateway.predict(
        view, principal.tenant, body.instances, priority, timeout_ms, session_key, version
    )
    if result.content is not None:  # the replica's bytes are already this route's answer
        answer = Response(result.content, media_type="application/json")
        set_prediction_headers(answer, result)
        return answer
    set_prediction_headers(response, result)
    return PredictResponse(
        predictions=result.body["predictions"], model=view.model, version=result.version
    )


@router.post(
    "/v1/models/{name}:predict",
    summary="Predict with the deployed version(s)",
    response_model=PredictResponse,
)
async def predict(
    name: ModelName,
    body: PredictRequest,
    request: Request,
    response: Response,
    principal: PrincipalDep,
    x_ember_session: Annotated[str | None, Header(max_length=256)] = None,
) -> PredictResponse | Response:
    """Routed by the deployment's traffic weights (canary); `X-Ember-Session` keeps a
    session on one replica while it is not overloaded."""
    return await _predict(request, response, principal, name, body, None, x_ember_session)


@router.post(
    "/v1/models/{name}/versions/{version}:predict",
    summary="Predict with one version",
    response_model=PredictResponse,
)
async def predict_version(
    name: ModelName,
    version: VersionRef,
    body: PredictRequest,
    request: Request,
    response: Response,
    principal: PrincipalDep,
    x_ember_session: Annotated[str | None, Header(max_length=256)] = None,
) -> PredictResponse | Response:
    return await _predict(request, response, principal, name, body, version, x_ember_session)


@router.get("/v1/deployments/{name}/replicas", summary="A deployment's replicas")
def replicas(
    name: Annotated[str, Path(pattern=NAME_PATTERN)],
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
) -> dict[str, Any]:
    deployment = deployments.get(session, principal.tenant_id, name)
    gateway = gateway_of(request)
    key = (deployment.tenant_id, deployment.name)
    events = [e for e in gateway.controller.events if (e["tenant_id"], e["deployment"]) == key]
    return {"deployment": name, "replicas": gateway.controller.replicas_of(key), "events": events}
