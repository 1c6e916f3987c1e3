"""vLLM load format ``ember``: weights reach vLLM through Ember's loader.

vLLM builds the model from ``config.json`` and then asks the load format's loader to
fill it. This loader streams ``(name, tensor)`` pairs from ``WeightLoader.stream`` —
object store → NVMe cache (single-flight, sha256-verified) → the device vLLM loads on —
straight into ``model.load_weights``, so vLLM's own download path is never used.

The model is loaded in vLLM's worker, a separate (spawned) process. Two hooks make this
module run there, both harmless when both fire:

* the engine passes ``--worker-extension-cls ember.engine.vllm_plugin.EmberWorkerExtension``;
  the worker imports this module to resolve that class, and the import registers the
  loader (``register()`` at the bottom) — no package metadata needed;
* ``register`` is also fit for a ``vllm.general_plugins`` entry point, which vLLM calls in
  every process.

The engine hands the loader its target through ``model_loader_extra_config`` (model,
version, URI, sha256, the loader's settings) and the worker's log context through the
``_EMBER_VLLM_LOG_CONTEXT`` environment variable, so the worker's lines — vLLM's
included — carry model and version like every other line of the replica.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ember.config import Settings
from ember.domain.manifest import ManifestFile
from ember.domain.spec import VersionSpec
from ember.errors import ArtifactError
from ember.logs import bind_process, configure_logging, get_logger, model_context

LOAD_FORMAT = "ember"
LOG_CONTEXT_ENV = "_EMBER_VLLM_LOG_CONTEXT"
# Settings a worker needs to reach the store and the cache (never secrets such as the
# admin key or database URL: vLLM logs its whole config, extra config included).
_LOADER_SETTING_PREFIXES = ("data_dir", "object_store_url", "file_roots", "s3_", "cache_",
                            "artifact_", "loader_", "log_")  # fmt: skip

log = get_logger(__name__)
_PINS: list[Any] = []
"""Cache pins of the weights this worker serves: held for the life of the process."""


class LoadTarget(BaseModel):
    """What the ``ember`` load format loads (``model_loader_extra_config``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    version: str
    artifact_uri: str
    sha256: str
    files: tuple[ManifestFile, ...] | None = None
    """A directory version's manifest (``VersionSpec.files``)."""
    settings: dict[str, Any]
    report_path: str | None = None
    """Where the worker writes the ``LoadReport`` as JSON for the engine to read."""

    def loader_settings(self) -> Settings:
        return Settings(**self.settings)

    def spec(self) -> VersionSpec:
        """The version as the loader takes it (the engine fields do not matter here)."""
        return VersionSpec(model=self.model, version=self.version, artifact_uri=self.artifact_uri,
                           sha256=self.sha256, files=self.files, engine="vllm")  # fmt: skip


def loader_settings_dict(settings: Settings) -> dict[str, Any]:
    dumped = settings.model_dump(mode="json")
    return {k: v for k, v in dumped.items() if k.startswith(_LOADER_SETTING_PREFIXES)}


def log_context_env(settings: Settings, **fields: Any) -> str:
    """The value of ``_EMBER_VLLM_LOG_CONTEXT`` for the processes vLLM starts."""
    return json.dumps({"level": settings.log_level, "format": settings.log_format,
                       "fields": fields, "parent": os.getpid()})  # fmt: skip


class EmberWorkerExtension:
    """Mixed into vLLM's worker class; resolving it imports (and so registers) this
    module in the worker process."""


def register() -> None:
    """Register the ``ember`` load format (idempotent; also a general-plugin entry point)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    _configure_worker_logging()
    if LOAD_FORMAT not in _LOAD_FORMAT_TO_MODEL_LOADER:
        from vllm.model_executor.model_loader import register_model_loader

        register_model_loader(LOAD_FORMAT)(_loader_class())


def _configure_worker_logging() -> None:
    raw = os.environ.get(LOG_CONTEXT_ENV)
    if not raw:
        return
    ctx = json.loads(raw)
    if ctx.get("parent") == os.getpid():  # the engine's own process is configured already
        return
    configure_logging(ctx.get("level", "INFO"), ctx.get("format", "auto"))
    bind_process(**ctx.get("fields", {}))


def _loader_class() -> type:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class EmberModelLoader(BaseModelLoader):  # type: ignore[misc]
        """Streams a version's safetensors through ``WeightLoader`` into the model."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.target = LoadTarget.model_validate(load_config.model_loader_extra_config)

        def download_model(self, model_config: Any) -> None:
            from ember.loader.load import WeightLoader

            t = self.target
            with model_context(t.model, t.version):
                WeightLoader(t.loader_settings()).warm_version(t.spec())

        def load_weights(self, model: Any, model_config: Any) -> None:
            with model_context(self.target.model, self.target.version):
                load_into(model, self.target)

    return EmberModelLoader


def load_into(model: Any, target: LoadTarget) -> None:
    """Stream the target's tensors into a vLLM model; fail on any parameter left unset."""
    from ember.loader.load import WeightLoader

    device = next(model.parameters()).device
    stream = WeightLoader(target.loader_settings()).stream_version(
        target.spec(), device=str(device)
    )
    loaded: set[str] | None = model.load_weights(iter(stream))
    if stream.report is None:  # the model stopped early: the load is verified only at the end
        for _ in stream:
            pass
    if stream.pin is not None:
        _PINS.append(stream.pin)
    report = stream.report
    assert report is not None
    if loaded is not None:
        missing = sorted({name for name, _ in model.named_parameters()} - loaded)
        if missing:
            raise ArtifactError(
                f"weights do not fit the model: {len(missing)} parameters not in the artifact "
                f"(first: {missing[:5]})",
                missing=missing[:50],
            )
    if target.report_path:
        path = Path(target.report_path)
        path.write_text(json.dumps(report.as_dict()))
    log.info("weights streamed into vLLM", device=str(device), cache=str(report.cache),
             bytes=report.bytes, seconds=round(report.seconds, 3))  # fmt: skip


register()
