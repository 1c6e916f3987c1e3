"""``ember engine`` (run one replica; the pools controller starts these) and ``ember
calibrate`` (fit a version's cost model)."""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ember.cli.common import commands, err, friendly_errors, load_settings

if TYPE_CHECKING:
    from ember.config import Settings
    from ember.engine.threads import CpuBudget

app = commands()


def _spec_from_registry(model: str, version: str, tenant: str) -> dict[str, object]:
    from ember.api.app import prepare
    from ember.registry import catalog
    from ember.registry.db import session_scope
    from ember.registry.tenants import get_tenant

    engine, _ = prepare(load_settings())
    with session_scope(engine) as session:
        row_tenant = get_tenant(session, tenant)
        found = catalog.get_model(session, row_tenant.id or 0, model)
        row = catalog.get_version(session, found, version)
        catalog.require_ready(found, row)
        return catalog.version_spec(found, row)


@app.command()
def engine(
    port: Annotated[int, typer.Option(help="Port of the replica's internal API.")],
    host: Annotated[str, typer.Option(help="Bind address (loopback by default).")] = "127.0.0.1",
    spec_file: Annotated[Path | None, typer.Option(help="VersionSpec JSON to serve.")] = None,
    model: Annotated[str | None, typer.Option(help="Serve this model (from the registry).")] = None,
    version: Annotated[str | None, typer.Option(help="... at this version.")] = None,
    tenant: Annotated[str, typer.Option(help="Tenant owning --model.")] = "default",
    standby: Annotated[bool, typer.Option(help="Start with no version; wait for /assign.")] = False,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ...")] = "cpu",
    replica_id: Annotated[str | None, typer.Option(help="Id in logs and headers.")] = None,
    max_batch_size: Annotated[int, typer.Option()] = 32,
    max_queue_delay_ms: Annotated[float, typer.Option()] = 5.0,
    max_queue: Annotated[int, typer.Option(help="Queued instances per priority.")] = 1024,
    max_input_size: Annotated[int, typer.Option(help="Tokens/elements per instance.")] = 8192,
    max_batch_units: Annotated[int, typer.Option(help="Input size per batch.")] = 65536,
    threads: Annotated[int | None, typer.Option(help="Override the cgroup CPU quota.")] = None,
    reserve_bytes: Annotated[
        int, typer.Option(min=0, help="Standby on CPU: host memory to fault in for the weights.")
    ] = 0,
    parent_pid: Annotated[
        int | None,
        typer.Option(help="Stop once this process is no longer the parent (the API's pools)."),
    ] = None,
) -> None:
    """Run one replica of one model version (or a standby process) on HOST:PORT.

    Its API needs the secret given in ``EMBER_REPLICA_SECRET`` (read and removed from the
    environment at once) on every route but ``/healthz`` and ``/readyz``; started without
    one (by hand), it serves unauthenticated on a loopback address only."""
    from ember.domain.spec import REPLICA_SECRET_ENV
    from ember.engine.threads import apply_thread_limits, cpu_budget

    secret = os.environ.pop(REPLICA_SECRET_ENV, None) or None
    if secret is None and not _loopback(host):
        err.print(
            f"[red]{REPLICA_SECRET_ENV} is not set: a replica without a secret serves only on "
            "a loopback address (--host 127.0.0.1)[/red]"
        )
        raise typer.Exit(2)
    from ember.work.process import stop_with_parent

    stop_with_parent(parent_pid)  # an API killed outright (SIGKILL, OOM) leaves no replica
    budget = cpu_budget(override=threads)
    apply_thread_limits(budget)  # before torch is imported: OpenMP reads it once
    settings = load_settings()
    with friendly_errors():
        if spec_file is not None:
            raw = json.loads(spec_file.read_text())
        elif model and version:
            raw = _spec_from_registry(model, version, tenant)
        elif standby:
            raw = None
        else:
            err.print("[red]give --spec-file, --model and --version, or --standby[/red]")
            raise typer.Exit(2)
    _serve_replica(
        settings,
        raw,
        host,
        port,
        device,
        replica_id,
        budget,
        {
            "max_batch_size": max_batch_size,
            "max_queue_delay_ms": max_queue_delay_ms,
            "max_queue": max_queue,
            "max_input_size": max_input_size,
            "max_batch_units": max_batch_units,
        },
        reserve_bytes,
        secret,
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _serve_replica(
    settings: Settings,
    raw: dict[str, Any] | None,
    host: str,
    port: int,
    device: str,
    replica_id: str | None,
    budget: CpuBudget,
    policy: dict[str, Any],
    reserve_bytes: int = 0,
    secret: str | None = None,
) -> None:
    from ember.engine.heap import frozen_after

    # Everything imported before serving lives as long as the process: imported with the
    # cyclic GC off, then frozen (ember.engine.heap), so that a collection during a weight
    # load or a request walks only what was made since.
    with frozen_after():
        import uvicorn

        from ember.domain.spec import BatchPolicy, VersionSpec
        from ember.engine.replica import Replica
        from ember.engine.server import create_replica_app
        from ember.engine.threads import apply_thread_limits
        from ember.logs import bind_process, configure_logging, get_logger
        from ember.web.http import SERVER_OPTIONS

        configure_logging(settings.log_level, settings.log_format)
        import torch  # noqa: F401 - the runtime, before serving (standby = warm imports)

        apply_thread_limits(budget)
        spec = VersionSpec.model_validate(raw) if raw is not None else None
        if spec is None:
            _preimport_engines()
    if spec is None and reserve_bytes and device == "cpu":
        from ember.loader.pagecache import RESERVE

        RESERVE.fill(reserve_bytes)  # the weights' memory, faulted in while nothing waits
    replica = Replica(settings, BatchPolicy(**policy), device, replica_id, budget.threads)
    if spec is not None:
        bind_process(model=spec.model, version=spec.version)
    get_logger(__name__).info(
        "replica starting",
        threads=budget.threads,
        threads_source=budget.source,
        port=port,
        standby=spec is None,
        uid=os.geteuid(),
    )
    if secret is None:
        get_logger(__name__).warning(
            "no replica secret: the replica's API is unauthenticated (loopback only)"
        )
    uvicorn.run(
        create_replica_app(replica, spec, secret),
        host=host,
        port=port,
        **SERVER_OPTIONS,
    )


@app.command()
def calibrate(
    ref: Annotated[str, typer.Argument(metavar="MODEL:VERSION")],
    device: Annotated[str, typer.Option(help="Device to calibrate on.")] = "cpu",
    repeats: Annotated[int, typer.Option(min=1, max=100)] = 5,
    tenant: Annotated[
        str | None, typer.Option(help="The version's tenant (default: the admin key's).")
    ] = None,
) -> None:
    """Measure MODEL:VERSION on this machine, fit its cost model (model units) and store
    it on the version for this hardware. Needs an admin key (``EMBER_API_KEY``)."""
    from ember.client import EmberClient
    from ember.costmodel import hardware_key
    from ember.domain.spec import VersionSpec
    from ember.engine.base import engine_class
    from ember.engine.calibrate import calibrate as run_calibration

    model, sep, version = ref.partition(":")
    if not sep or not model or not version:
        raise typer.BadParameter("give MODEL:VERSION")
    settings = load_settings()
    api = EmberClient.from_env()
    if tenant:
        api.http.headers["X-Ember-Tenant"] = tenant
    with friendly_errors():
        row = api.get(f"/v1/models/{model}/versions/{version}")
        spec = VersionSpec(
            model=model,
            version=version,
            artifact_uri=row["artifact_uri"],
            sha256=row["sha256"] or "",
            engine=row["engine"],
            engine_config=row["engine_config"],
            input_schema=row["input_schema"],
            output_schema=row["output_schema"],
        )
        runtime = engine_class(spec.engine)(spec, settings, device)
        runtime.load()
        cost = run_calibration(runtime, repeats=repeats)
        name = None
        if device.startswith("cuda"):
            import torch

            name = torch.cuda.get_device_name(torch.device(device))
        hardware = hardware_key(device, name)
        stored = api.request(
            "PUT",
            f"/v1/models/{model}/versions/{version}/cost-models/{hardware}",
            json=cost.to_dict(),
        )
        runtime.close()
    print(json.dumps({"hardware": hardware, **stored["cost_models"][hardware]}, indent=2))


def _preimport_engines() -> None:
    """A standby process pays for the imports now, so that an assignment is only a
    weight load: the engines, transformers and its most common model code."""
    import importlib

    for name in (
        "ember.engine.torch_engine",
        "ember.engine.transformers_engine",
        "transformers.models.auto.modeling_auto",
        "transformers.models.bert.modeling_bert",
        "transformers.models.llama.modeling_llama",
    ):
        try:
            importlib.import_module(name)
        except ImportError:  # an engine whose library is not installed here
            continue
