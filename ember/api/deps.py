"""Injectables for routes, named to read as prose (``SessionDep``, ``PrincipalDep``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlmodel import Session

from ember.config import Settings
from ember.errors import Unauthenticated
from ember.registry.tenants import Principal, authenticate

_bearer = HTTPBearer(auto_error=False, description="An Ember API key.")


def get_session(request: Request) -> Iterator[Session]:
    # Routes commit explicitly (so a failed commit is still an error response);
    # whatever is left uncommitted is rolled back here.
    with Session(request.app.state.engine, expire_on_commit=False) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_principal(
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    x_ember_tenant: Annotated[
        str | None,
        Header(description="Admin keys only: act for this tenant.", max_length=63),
    ] = None,
) -> Principal:
    if credentials is None or not credentials.credentials:
        raise Unauthenticated("send an API key as `Authorization: Bearer <key>`")
    if len(credentials.credentials) > 512:
        raise Unauthenticated("the API key is not valid (unknown or revoked)")
    return authenticate(session, credentials.credentials, x_ember_tenant)


PrincipalDep = Annotated[Principal, Depends(get_principal)]

Limit = Annotated[int, Query(ge=1, le=500, description="Page size.")]
Cursor = Annotated[
    str | None, Query(max_length=128, description="`next_cursor` from the previous page.")
]
