"""``ember keys``: create, list and revoke API keys."""

from __future__ import annotations

from typing import Annotated

import typer

from ember.cli.common import JsonOpt, client, emit, friendly_errors, group, load_settings, out

app = group("API keys.")


@app.command("create")
def keys_create(
    name: Annotated[str, typer.Option(help="A label for the key.")] = "default",
    tenant: Annotated[str | None, typer.Option(help="Tenant (default: yours).")] = None,
    admin: Annotated[bool, typer.Option(help="Create an admin key.")] = False,
    worker: Annotated[
        bool, typer.Option(help="Create a worker key (job and batch workers on other hosts).")
    ] = False,
    local: Annotated[
        bool, typer.Option(help="Write to the local registry directly (no API, no key needed).")
    ] = False,
) -> None:
    """Create an API key; its secret is printed once. Admin and worker keys need an admin
    key (or --local)."""
    if admin and worker:
        raise typer.BadParameter("give --admin or --worker, not both")
    scope = "admin" if admin else "worker" if worker else "tenant"
    if local:
        out.print(_local_key(name, tenant, scope))
        return
    with friendly_errors():
        body = {"name": name, "tenant": tenant, "scope": scope}
        emit(client().post("/v1/keys", body))


def _local_key(name: str, tenant: str | None, scope: str) -> str:
    from ember.api.app import prepare
    from ember.registry.db import session_scope
    from ember.registry.tables import KeyScope
    from ember.registry.tenants import DEFAULT_TENANT, create_key, get_tenant

    engine, _ = prepare(load_settings())
    with friendly_errors(), session_scope(engine) as session:
        row = get_tenant(session, tenant or DEFAULT_TENANT)
        _, key = create_key(session, row, name, KeyScope(scope))
    return key


@app.command("ls")
def keys_ls(as_json: JsonOpt = False) -> None:
    """List your tenant's keys (never their secrets)."""
    with friendly_errors():
        cols = ["id", "name", "scope", "prefix", "created_at", "revoked_at"]
        emit(client().paginate("/v1/keys"), cols, as_json)


@app.command("revoke")
def keys_revoke(key_id: int) -> None:
    """Revoke a key by id."""
    with friendly_errors():
        emit(client().delete(f"/v1/keys/{key_id}"))
