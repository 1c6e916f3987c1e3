"""``/metrics``: the pools' and the gateway's Prometheus series, never open to anyone.

Two ways, the operator's choice (``EMBER_METRICS_PORT``):

- unset: ``GET /metrics`` on the API port needs a key like every other route. An admin
  key reads every series; any other key only its own tenant's (the series labelled
  ``tenant="<its name>"``: platform-wide series such as standby processes or the
  prediction log are the operator's). Prometheus scrapes it with a bearer token
  (``authorization: {credentials: <admin key>}`` in the scrape config).
- set: ``/metrics`` is not on the API port at all; it is served, without a key, on that
  port bound to ``127.0.0.1`` only (a sidecar or a node agent scrapes it there).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Path, Request, Response
from fastapi.responses import PlainTextResponse
from redis.exceptions import RedisError

from ember.api.deps import PrincipalDep, SessionDep
from ember.engine.metrics import LOOPBACK, MetricsServer
from ember.errors import NotReady
from ember.logs import get_logger
from ember.registry import deployments
from ember.registry.schemas import NAME_PATTERN

log = get_logger(__name__)
MEDIA = "text/plain; version=0.0.4; charset=utf-8"

router = APIRouter(tags=["health"])
costs = APIRouter(prefix="/v1/deployments", tags=["deployments"])
"""``GET /v1/deployments/{name}/cost`` (included with the control plane's dependencies)."""
DeploymentName = Annotated[str, Path(pattern=NAME_PATTERN, description="Deployment name.")]


def render(app: FastAPI, tenant: str | None) -> bytes:
    """Every series (``tenant`` None) or that tenant's; nothing without the pools."""
    gateway = getattr(app.state, "gateway", None)
    if gateway is None:
        return b""
    data: bytes = gateway.control.metrics.render(tenant)
    return data


@router.get(
    "/metrics",
    summary="Prometheus metrics of the pools and the gateway (an admin key: every tenant's)",
    response_class=PlainTextResponse,
)
def metrics(request: Request, principal: PrincipalDep) -> Response:
    tenant = None if principal.is_admin else principal.tenant
    return Response(render(request.app, tenant), media_type=MEDIA)


@costs.get("/{name}/cost", summary="Cost per successful answer per version (windows, lifetime)")
def cost(
    request: Request, name: DeploymentName, principal: PrincipalDep, session: SessionDep
) -> dict[str, Any]:
    """Replica-seconds per 2xx answer for each version of the deployment: over the last 5
    minutes, hour and day (``window``) and since counting began (``lifetime``); ``null``
    where no answer was sent. The same figure from every API process (the counts are
    shared through Redis); ``breakdown`` holds what each figure is made of (replica-seconds
    per tier, the apportioned share of standby processes, successes, standby starts).
    503 on an API process that runs no pools controller."""
    deployment = deployments.get(session, principal.tenant_id, name)
    gateway = getattr(request.app.state, "gateway", None)
    if gateway is None:
        raise NotReady("this API process runs no pools controller (EMBER_POOLS_ENABLED=false)")
    try:
        snapshot = gateway.control.metrics.costs.snapshot()
    except RedisError as exc:
        log.warning("could not read the cost counts", error=str(exc))
        raise NotReady("the shared cost counts cannot be read now; try again") from exc
    figures: dict[str, Any] = snapshot.of_deployment(deployment.tenant_id, deployment.name)
    return figures


class LoopbackMetrics(MetricsServer):
    """The API's every series on ``127.0.0.1:<port>`` (``EMBER_METRICS_PORT``): only this
    host reaches it."""

    def __init__(self, app: FastAPI, port: int) -> None:
        super().__init__(lambda: render(app, None), port, LOOPBACK)
        self.app = app
