"""``ember tenants``: create and list tenants (admin)."""

from __future__ import annotations

from ember.cli.common import JsonOpt, client, emit, friendly_errors, group

app = group("Tenants (admin).")


@app.command("create")
def tenants_create(name: str, as_json: JsonOpt = False) -> None:
    """Create a tenant."""
    with friendly_errors():
        emit(client().post("/v1/tenants", {"name": name}), as_json=as_json)


@app.command("ls")
def tenants_ls(as_json: JsonOpt = False) -> None:
    """List tenants."""
    with friendly_errors():
        emit(client().paginate("/v1/tenants"), ["name", "created_at"], as_json)
