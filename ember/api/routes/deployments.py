"""Deployments: routing (canary, promote, rollback) and pool policy."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response, status

from ember.api.deps import Cursor, Limit, PrincipalDep, SessionDep, SettingsDep
from ember.errors import NotReady
from ember.registry import deployments, quotas
from ember.registry.schemas import (
    NAME_PATTERN,
    CanaryRequest,
    DeploymentCreate,
    DeploymentPublic,
    DeploymentUpdate,
    Page,
    PromoteRequest,
    RevisionPublic,
)
from ember.web.problems import problem_responses

router = APIRouter(prefix="/v1/deployments", tags=["deployments"])
DeploymentName = Annotated[str, Path(pattern=NAME_PATTERN, description="Deployment name.")]


def _controller_sees(request: Request) -> None:
    """Read your writes: this API process's pools controller re-reads the registry now, so
    a request right after the change already sees it (other API processes within their
    next registry read, about a second)."""
    pools = getattr(request.app.state, "pools", None)
    if pools is not None:
        pools.refresh()


OVER_QUOTA = problem_responses((403, "Over the tenant's replicas, GPUs, CPU or memory quota"))


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    summary="Create a deployment",
    responses=OVER_QUOTA,
)
def create(
    request: Request,
    body: DeploymentCreate,
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
) -> DeploymentPublic:
    """Serves `version` (which must be `ready`) as `production` at 100 % of traffic. Its
    worst case (`max_replicas` x `placement`) must fit the tenant's quotas (403)."""
    limits = quotas.limits_for(session, settings, principal.tenant_id)
    deployment = deployments.create(session, principal.tenant_id, body, limits)
    session.commit()
    _controller_sees(request)
    return deployments.public(session, deployment)


@router.get("", summary="List deployments")
def list_all(
    principal: PrincipalDep, session: SessionDep, limit: Limit = 50, cursor: Cursor = None
) -> Page[DeploymentPublic]:
    rows, next_cursor = deployments.list_page(session, principal.tenant_id, limit, cursor)
    return Page(items=[deployments.public(session, d) for d in rows], next_cursor=next_cursor)


@router.get("/{name}", summary="Get a deployment")
def get(name: DeploymentName, principal: PrincipalDep, session: SessionDep) -> DeploymentPublic:
    return deployments.public(session, deployments.get(session, principal.tenant_id, name))


@router.patch("/{name}", summary="Change pool policy or fallback chain", responses=OVER_QUOTA)
def update(
    request: Request,
    name: DeploymentName,
    body: DeploymentUpdate,
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
) -> DeploymentPublic:
    deployment = deployments.get(session, principal.tenant_id, name)
    limits = quotas.limits_for(session, settings, principal.tenant_id)
    deployments.update(session, deployment, body, limits)
    session.commit()
    _controller_sees(request)
    return deployments.public(session, deployment)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, summary="Delete a deployment")
def delete(
    request: Request, name: DeploymentName, principal: PrincipalDep, session: SessionDep
) -> Response:
    deployments.delete(session, deployments.get(session, principal.tenant_id, name))
    session.commit()
    _controller_sees(request)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/{name}:canary", summary="Send a share of traffic to a new version", responses=OVER_QUOTA
)
def canary(
    request: Request,
    name: DeploymentName,
    body: CanaryRequest,
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
) -> DeploymentPublic:
    deployment = deployments.get(session, principal.tenant_id, name)
    limits = quotas.limits_for(session, settings, principal.tenant_id)
    deployments.canary(session, deployment, body, limits)
    session.commit()
    _controller_sees(request)
    return deployments.public(session, deployment)


@router.post("/{name}:promote", summary="Make a version (default: the canary) production")
def promote(
    request: Request,
    name: DeploymentName,
    principal: PrincipalDep,
    session: SessionDep,
    body: PromoteRequest | None = None,
) -> DeploymentPublic:
    deployment = deployments.get(session, principal.tenant_id, name)
    deployments.promote(session, deployment, body or PromoteRequest())
    session.commit()
    _controller_sees(request)
    return deployments.public(session, deployment)


@router.post("/{name}:rollback", summary="Drop the canary, or return to the previous production")
def rollback(
    request: Request, name: DeploymentName, principal: PrincipalDep, session: SessionDep
) -> DeploymentPublic:
    deployment = deployments.get(session, principal.tenant_id, name)
    deployments.rollback(session, deployment)
    session.commit()
    _controller_sees(request)
    return deployments.public(session, deployment)


@router.get("/{name}/revisions", summary="Routing history")
def history(
    name: DeploymentName, principal: PrincipalDep, session: SessionDep
) -> list[RevisionPublic]:
    deployment = deployments.get(session, principal.tenant_id, name)
    return [RevisionPublic.model_validate(r) for r in deployments.revisions(session, deployment)]


@router.get("/{name}/autoscaler", summary="What the autoscaler forecasts and wants, and why")
def autoscaler(
    request: Request, name: DeploymentName, principal: PrincipalDep, session: SessionDep
) -> dict[str, Any]:
    """For the production version: the demand forecast at each tier's horizon (hot one
    promotion from warm ahead, hot + warm one standby load ahead, all tiers one cold
    start ahead), the replicas wanted per tier with the reasons, the promotion times it
    plans with (learned per tier), and its last decisions. 503 on an API process that
    runs no pools controller."""
    deployment = deployments.get(session, principal.tenant_id, name)
    pools = getattr(request.app.state, "pools", None)
    if pools is None:
        raise NotReady("this API process runs no pools controller (EMBER_POOLS_ENABLED=false)")
    key = (deployment.tenant_id, deployment.name)
    return {"deployment": name, **pools.autoscaler_of(key)}
