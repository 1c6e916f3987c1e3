"""``ember cache ls | warm MODEL:VERSION | evict MODEL:VERSION``.

Torch-free. ``warm`` needs a model version's artifact URI and sha256: the registry
supplies them through a ``VersionResolver`` given to ``make_cache_app``; without one
(or to bypass it) pass ``--uri`` and ``--sha256``. ``app``, what ``ember cache`` is,
resolves them through the registry API (so a key sees only its own tenant's models).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any, Protocol

import typer

from ember.cli.common import client
from ember.errors import Conflict, EmberError, NotFound

if TYPE_CHECKING:
    from ember.config import Settings


class VersionResolver(Protocol):
    def __call__(
        self, settings: Settings, model: str, version: str
    ) -> tuple[str, str, list[dict[str, Any]] | None]:
        """``(artifact_uri, sha256, files)`` of a registered, validated model version (its
        manifest: a directory version's files); raises ``NotFound`` when there is none."""
        ...


def _split(ref: str) -> tuple[str, str]:
    model, sep, version = ref.rpartition(":")
    if not sep or not model or not version:
        raise typer.BadParameter(f"expected MODEL:VERSION, got {ref!r}")
    return model, version


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def make_cache_app(resolve: VersionResolver | None = None) -> typer.Typer:
    app = typer.Typer(help="Inspect and manage the NVMe weight cache.", no_args_is_help=True)

    def fail(exc: EmberError) -> None:
        typer.echo(f"error: {exc.detail}", err=True)
        raise typer.Exit(1)

    @app.command("ls")
    def ls() -> None:
        """List cache entries, least recently used first."""
        from ember.config import get_settings
        from ember.loader.cache import WeightCache

        settings = get_settings()
        cache = WeightCache.from_settings(settings)
        entries = sorted(cache.ls(), key=lambda e: e.last_used)
        typer.echo(f"{'MODEL:VERSION':32} {'SHA256':14} {'SIZE':>10} {'STATE':9} LAST USED")
        for e in entries:
            state = "filling" if e.filling else "pinned" if e.pinned else (
                "ready" if e.complete else "partial"
            )  # fmt: skip
            used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used))
            typer.echo(f"{e.key!s:32} {e.key.sha256[:12]:14} {_human(e.size):>10} "
                       f"{state:9} {used}")  # fmt: skip
        total = sum(e.size for e in entries)
        typer.echo(f"{len(entries)} entries, {_human(total)} of {_human(cache.max_bytes)}")

    @app.command("warm")
    def warm(
        ref: Annotated[str, typer.Argument(metavar="MODEL:VERSION")],
        uri: Annotated[str | None, typer.Option(help="Artifact URI (skips the registry).")] = None,
        sha256: Annotated[str | None, typer.Option(help="Expected sha256 (with --uri).")] = None,
    ) -> None:
        """Fetch a version's files into the cache now, so a later start is a hit."""
        from ember.config import get_settings
        from ember.domain.spec import VersionSpec
        from ember.loader.load import WeightLoader

        model, version = _split(ref)
        settings = get_settings()
        files = None
        try:
            if uri is None or sha256 is None:
                if resolve is None:
                    raise NotFound("no registry wired to `ember cache`: pass --uri and --sha256")
                uri, sha256, files = resolve(settings, model, version)
            loader = WeightLoader(settings)
            if uri.endswith("/"):  # a directory version: every file of its manifest
                started = time.perf_counter()
                spec = VersionSpec(model=model, version=version, artifact_uri=uri,
                                   sha256=sha256, files=files, engine="torch")  # fmt: skip
                loader.warm_version(spec)
                typer.echo(f"{ref}: {len(files or ())} files cached "
                           f"in {time.perf_counter() - started:.1f}s")  # fmt: skip
                return
            result = loader.warm(model, version, uri, sha256)
        except EmberError as exc:
            fail(exc)
            return
        if result is None:
            typer.echo(f"{ref}: already cached")
        else:
            typer.echo(f"{ref}: cached {_human(result.bytes_fetched)} in {result.seconds:.1f}s")

    @app.command("evict")
    def evict(ref: Annotated[str, typer.Argument(metavar="MODEL:VERSION")]) -> None:
        """Remove a version's entries (refused while a live replica pins one)."""
        from ember.config import get_settings
        from ember.loader.cache import WeightCache

        model, version = _split(ref)
        try:
            gone = WeightCache.from_settings(get_settings()).evict(model, version)
        except EmberError as exc:
            fail(exc)
            return
        typer.echo(f"{ref}: evicted {len(gone)} entr{'y' if len(gone) == 1 else 'ies'}")

    return app


def resolve_version(
    settings: Settings, model: str, version: str
) -> tuple[str, str, list[dict[str, Any]] | None]:
    """``ember cache warm``: a version's artifact, digest and manifest, from the registry
    API (so a key sees only its own tenant's models)."""
    row = client().get(f"/v1/models/{model}/versions/{version}")
    if row["status"] != "ready" or not row["sha256"]:
        raise Conflict(f"{model}:{version} is {row['status']}, not ready to cache")
    return str(row["artifact_uri"]), str(row["sha256"]), row.get("files")


app = make_cache_app(resolve_version)
