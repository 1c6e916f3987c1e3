"""``ember deployments``: routing (canary, promote, rollback) and pool policy."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from ember.cli.common import JsonOpt, client, emit, friendly_errors, group, out
from ember.errors import InvalidInput

app = group("Deployments: routing and pool policy.")

POLICY_OPTIONS = ("min_hot", "max_replicas", "target_utilization", "max_batch_size",
                  "max_queue_delay_ms", "timeout_ms", "priority")  # fmt: skip


def _policy(pairs: list[str]) -> dict[str, Any]:
    policy: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in (*POLICY_OPTIONS, "scale_to_zero"):
            raise InvalidInput(f"--set takes KEY=VALUE with KEY in {', '.join(POLICY_OPTIONS)}")
        policy[key] = json.loads(value) if value not in ("", None) else value
    return policy


SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Pool policy KEY=VALUE (repeatable).")
]


@app.command("create")
def deployments_create(
    model: str,
    version: Annotated[str, typer.Option("--version", "-v", help="The production version.")],
    name: Annotated[str | None, typer.Option(help="Default: the model's name.")] = None,
    fallback: Annotated[list[str] | None, typer.Option(help="Fallback version.")] = None,
    set_: SetOpt = None,
) -> None:
    """Deploy MODEL at VERSION."""
    with friendly_errors():
        body = {"model": model, "version": version, "name": name, "fallback": fallback or [],
                **_policy(set_ or [])}  # fmt: skip
        emit(client().post("/v1/deployments", body))


@app.command("ls")
def deployments_ls(as_json: JsonOpt = False) -> None:
    """List deployments."""
    with friendly_errors():
        cols = ["name", "model", "traffic", "aliases", "min_hot", "max_replicas", "revision"]
        emit(client().paginate("/v1/deployments"), cols, as_json)


@app.command("get")
def deployments_get(name: str) -> None:
    """Show a deployment."""
    with friendly_errors():
        emit(client().get(f"/v1/deployments/{name}"))


@app.command("update")
def deployments_update(name: str, set_: SetOpt = None) -> None:
    """Change pool policy, e.g. `--set min_hot=2`."""
    with friendly_errors():
        emit(client().patch(f"/v1/deployments/{name}", _policy(set_ or [])))


@app.command("canary")
def deployments_canary(
    name: str,
    version: Annotated[str, typer.Option("--version", "-v")],
    weight: Annotated[int, typer.Option(help="Percent of traffic.")] = 10,
) -> None:
    """Send WEIGHT % of traffic to VERSION."""
    with friendly_errors():
        emit(
            client().post(f"/v1/deployments/{name}:canary", {"version": version, "weight": weight})
        )


@app.command("promote")
def deployments_promote(
    name: str, version: Annotated[str | None, typer.Option("--version", "-v")] = None
) -> None:
    """Make the canary (or VERSION) production at 100 %."""
    with friendly_errors():
        emit(client().post(f"/v1/deployments/{name}:promote", {"version": version}))


@app.command("rollback")
def deployments_rollback(name: str) -> None:
    """Drop the canary, or go back to the previous production version."""
    with friendly_errors():
        emit(client().post(f"/v1/deployments/{name}:rollback"))


@app.command("rm")
def deployments_rm(name: str) -> None:
    """Delete a deployment."""
    with friendly_errors():
        client().delete(f"/v1/deployments/{name}")
        out.print(f"deleted deployment {name}")


@app.command("autoscaler")
def deployments_autoscaler(name: str, as_json: JsonOpt = False) -> None:
    """What the autoscaler forecasts at each tier's horizon, wants per tier and why."""
    with friendly_errors():
        view: dict[str, Any] = client().get(f"/v1/deployments/{name}/autoscaler")
        if as_json:
            emit(view)
            return
        out.print(autoscaler_text(view))


def autoscaler_text(view: dict[str, Any]) -> str:
    """``GET /v1/deployments/{name}/autoscaler`` in a few lines."""
    promo = view.get("promotion_s") or {}
    lines = [
        f"deployment {view.get('deployment')}, production version {view.get('version')}"
        + ("" if view.get("acting", True) else " (this API process follows the leader)"),
        "promotion to hot (learned p95): "
        + ", ".join(f"{t} {promo.get(t)} s" for t in ("warm", "standby", "cold")),
    ]
    for s in view.get("forecast") or []:
        lines.append(
            f"  {s['tier']:8} covers {s['units_per_s']:.3g} u/s at +{s['horizon_s']:.3g} s "
            f"(from {s['from']}) -> {s['replicas']}"
        )
    desired = view.get("desired")
    if desired:
        lines.append(
            f"desired: hot {desired['hot']}, warm {desired['warm']}, standby {desired['standby']}"
        )
        lines += [f"  - {r}" for r in view.get("reasons") or []]
    else:
        lines.append("no decision yet (the autoscaler starts with the first tick)")
    return "\n".join(lines)
