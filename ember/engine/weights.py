"""Putting a version's weights into a torch module through Ember's loader, without an
extra copy: the module adopts the loaded tensors (``load_state_dict(assign=True)``).

The module is first built on the meta device (no memory, no random init). A module with
non-persistent buffers computed in ``__init__`` (BERT's ``position_ids``) cannot come from
meta, so it is then built for real — with initialisation skipped — and adopts the same
already-loaded tensors.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ember.config import Settings
from ember.domain.spec import Tier, VersionSpec
from ember.engine.base import Engine
from ember.errors import ArtifactError
from ember.loader.load import LoadedWeights, WeightLoader

if TYPE_CHECKING:
    import torch

_LOADERS: dict[int, WeightLoader] = {}


def loader_for(settings: Settings) -> WeightLoader:
    """One loader per settings object (it holds the cache and its staging memory)."""
    key = id(settings)
    if key not in _LOADERS:
        _LOADERS[key] = WeightLoader(settings)
    return _LOADERS[key]


@contextlib.contextmanager
def _skip_init() -> Iterator[None]:
    import importlib

    for where in ("transformers.initialization", "transformers.modeling_utils"):  # 5.x, 4.x
        try:
            no_init_weights = importlib.import_module(where).no_init_weights
        except (ImportError, AttributeError):
            continue
        with no_init_weights():
            yield
        return
    yield


def build_and_load(
    build: Callable[[], torch.nn.Module],
    spec: VersionSpec,
    settings: Settings,
    device: str,
    strip_prefix: str = "",
) -> tuple[torch.nn.Module, LoadedWeights]:
    import torch

    with torch.device("meta"):
        module = build()
    loaded = loader_for(settings).load_version(spec, device=device)  # one file or a manifest
    try:
        tensors = _matching(module, loaded.tensors, strip_prefix)
        module.load_state_dict(tensors, strict=True, assign=True)
        if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            with torch.device(device), _skip_init():
                module = build()
            module.load_state_dict(tensors, strict=True, assign=True)
    except BaseException:
        if loaded.pin is not None:
            loaded.pin.release()
        raise
    return module.eval(), loaded


def _matching(
    module: torch.nn.Module, tensors: dict[str, Any], strip_prefix: str
) -> dict[str, Any]:
    expected = set(module.state_dict().keys())
    if strip_prefix and not expected & set(tensors):
        tensors = {k.removeprefix(strip_prefix): v for k, v in tensors.items()}
    # Non-persistent buffers (computed in __init__) may be saved in old checkpoints: ignore.
    transient = {name for name, _ in module.named_buffers()} - expected
    missing = sorted(expected - set(tensors))
    unexpected = sorted(set(tensors) - expected - transient)
    if missing or unexpected:
        raise ArtifactError(
            f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}",
            missing=missing[:50],
            unexpected=unexpected[:50],
        )
    return {k: v for k, v in tensors.items() if k in expected}


class ModuleEngine(Engine):
    """An engine whose weights live in one torch module: tiers move or drop the module."""

    module: Any = None
    _pin: Any = None

    def adopt(self, module: Any, loaded: LoadedWeights) -> None:
        self.module, self._pin, self.load_report = module, loaded.pin, loaded.report
        self.tier = Tier.hot

    def set_tier(self, tier: Tier) -> None:
        cuda = self.module is not None and self.device.startswith("cuda")
        if cuda and Tier.standby not in (tier, self.tier) and tier is not self.tier:
            # warm: weights in pinned host memory, the device's freed; hot: one copy back.
            from ember.engine.hostcopy import demote, promote

            if tier is Tier.warm:
                demote(self.module)
            else:
                promote(self.module, self.device)
            self.tier = tier
            return
        super().set_tier(tier)

    def unload(self) -> None:
        self.module = None
        if self._pin is not None:
            self._pin.release()  # the cache may evict the entry again
            self._pin = None
        gc.collect()
