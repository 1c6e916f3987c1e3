"""``torch`` engine: a module built by an importable factory, weights from the artifact.

engine_config::

    {"factory": "package.module:build", "kwargs": {...}}

The factory must match ``EMBER_ENGINE_FACTORIES`` (and be defined in its module) unless
the version's tenant is trusted: checked before the module is imported
(``ember.domain.trust``).

input_schema (optional, checked per instance)::

    {"shape": [16], "dtype": "float32"}

Each instance is a nested list of numbers of that shape; the output is the module's
output for it, as nested lists. A tensor body (``ember.web.tensorbody``) is checked
whole: one shape check, one cast if its dtype is not the schema's, a view per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from ember.config import Settings
from ember.domain.spec import Tier, TorchOptions, VersionSpec
from ember.domain.trust import check_defined_in_module, check_factory, check_factory_kwargs
from ember.engine.base import Sized, import_object, register_engine
from ember.engine.weights import ModuleEngine, build_and_load
from ember.errors import InvalidInput
from ember.logs import get_logger

log = get_logger(__name__)
DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64,
          "int64": np.int64, "int32": np.int32}  # fmt: skip


@register_engine("torch")
class TorchEngine(ModuleEngine):
    def __init__(self, spec: VersionSpec, settings: Settings, device: str = "cpu") -> None:
        super().__init__(spec, settings, device)
        config = spec.engine_config
        # Code trust before any import: the factory must match this process's
        # EMBER_ENGINE_FACTORIES unless the registry marked the tenant trusted (a version
        # registered before the check, or under a wider setting, fails here with why).
        factory = check_factory(config.get("factory"), settings.engine_factories, spec.trusted)
        self.kwargs: dict[str, Any] = check_factory_kwargs(config.get("kwargs"))
        try:
            TorchOptions.model_validate(config)
        except ValidationError as exc:
            raise InvalidInput(f"invalid torch engine_config: {exc}") from exc
        self.factory = import_object(factory)
        check_defined_in_module(factory, self.factory, spec.trusted)
        schema = spec.input_schema or {}
        self.shape: tuple[int, ...] | None = tuple(schema["shape"]) if "shape" in schema else None
        dtype = schema.get("dtype", "float32")
        if dtype not in DTYPES:
            raise InvalidInput(f"input_schema dtype {dtype!r} is not one of {sorted(DTYPES)}")
        self.dtype = DTYPES[dtype]

    def load(self) -> None:
        def build() -> torch.nn.Module:
            module = self.factory(**self.kwargs)
            if not isinstance(module, torch.nn.Module):
                factory = self.spec.engine_config["factory"]
                raise InvalidInput(f"{factory} did not return a torch module")
            return module

        module, loaded = build_and_load(build, self.spec, self.settings, self.device)
        self.adopt(module, loaded)
        log.info(
            "weights loaded",
            seconds=round(loaded.report.seconds, 3),
            cache=str(loaded.report.cache),
        )

    def prepare(self, instance: Any) -> Sized:
        try:
            array = np.asarray(instance, dtype=self.dtype)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"instance is not a numeric array: {exc}") from exc
        if array.dtype == object or (self.shape is not None and array.shape != self.shape):
            raise InvalidInput(
                f"instance has shape {list(array.shape)}, expected {list(self.shape or ())}"
            )
        return Sized(array, int(array.size))

    def prepare_tensor(self, array: Any) -> list[Sized]:
        """A tensor body's instances checked at once: one shape and dtype check, then a
        view per row (no per-instance conversion)."""
        if self.shape is not None and tuple(array.shape[1:]) != self.shape:
            raise InvalidInput(
                f"instances have shape {list(array.shape[1:])}, expected {list(self.shape)}"
            )
        if array.dtype != self.dtype:  # as np.asarray(instance, dtype) casts JSON numbers
            array = array.astype(self.dtype)
        size = int(np.prod(array.shape[1:], dtype=np.int64))
        return [Sized(row, size) for row in array]

    def forward(self, batch: Sequence[Any]) -> list[Any]:
        if self.module is None or self.tier is not Tier.hot:
            raise InvalidInput(f"replica is {self.tier.value}, not hot")
        x = torch.from_numpy(np.stack(list(batch))).to(self.device)
        with torch.inference_mode():
            y = self.module(x)
        return list(y.cpu().tolist())

    def probe(self) -> Any:
        return np.zeros(self.shape or (1,), dtype=self.dtype).tolist()
