"""The ``Engine`` interface and the registry of implementations.

An engine turns instances (JSON values from a request) into outputs, a batch at a time.
It owns its weights across tiers. The scheduler calls ``prepare`` on the event loop
(cheap: validate and size) and ``forward`` on the single compute thread.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from ember.config import Settings
from ember.domain.spec import Tier, VersionSpec
from ember.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class Sized:
    """One validated instance with its size, for caps and model units."""

    value: Any
    input_size: int
    """Tokens (language models) or elements (tensor models)."""
    output_size: int = 0


class Engine(ABC):
    """One model version in one process. Subclasses register with ``@register_engine``."""

    name: ClassVar[str]

    def __init__(self, spec: VersionSpec, settings: Settings, device: str = "cpu") -> None:
        self.spec = spec
        self.settings = settings
        self.device = device
        self.tier: Tier = Tier.standby
        self.load_report: Any = None

    @abstractmethod
    def load(self) -> None:
        """Bring the weights onto the device (tier ``hot``) through the loader."""

    @abstractmethod
    def prepare(self, instance: Any) -> Sized:
        """Validate one instance and measure it; raise ``InvalidInput`` if it is wrong."""

    def prepare_tensor(self, array: Any) -> list[Sized]:
        """Validate and measure the instances of a tensor body (a numpy array, instances
        along its first dimension). Default: each row as a JSON instance through
        ``prepare``; tensor engines override it to check the whole array at once."""
        return [self.prepare(row) for row in array.tolist()]

    @abstractmethod
    def forward(self, batch: Sequence[Any]) -> list[Any]:
        """One batched pass over prepared values; one JSON-able output per value."""

    @abstractmethod
    def probe(self) -> Any:
        """A tiny valid instance for the black-box health check."""

    #: Engines that batch continuously themselves (vLLM) implement ``aforward``; the
    #: scheduler then awaits it on the event loop instead of the compute thread.
    aforward: Callable[[Sequence[Any]], Awaitable[list[Any]]] | None = None

    def routes(self) -> Any:
        """An ``APIRouter`` of engine-specific routes the replica mounts (OpenAI for
        vLLM), or None. Called on the event loop once the engine is loaded."""
        return None

    def metrics_text(self) -> bytes:
        """Extra Prometheus exposition text appended to the replica's ``/metrics``."""
        return b""

    def sample(self, input_size: int, output_size: int = 0) -> Any:
        """A valid instance of roughly this size (calibration). Engines whose inputs have a
        fixed size may ignore ``input_size``."""
        return self.probe()

    def set_tier(self, tier: Tier) -> None:
        """Move between tiers. Default: warm keeps the weights in host RAM (on CPU they
        already are, so only the tier changes); standby drops them."""
        if tier is self.tier:
            return
        if tier is Tier.standby:
            self.unload()
        elif self.tier is Tier.standby:
            self.load()
        self.tier = tier

    def unload(self) -> None:  # noqa: B027 - optional hook, most engines override it
        """Drop the weights (standby). Engines override to free their modules."""

    def close(self) -> None:
        self.unload()


E = TypeVar("E", bound=type[Engine])
ENGINES: dict[str, type[Engine]] = {}
_BUILTIN = {
    "torch": "ember.engine.torch_engine",
    "transformers": "ember.engine.transformers_engine",
    "vllm": "ember.engine.vllm_engine",
    "synthetic": "ember.engine.synthetic",
}


def register_engine(name: str) -> Callable[[E], E]:
    def wrap(cls: E) -> E:
        cls.name = name
        ENGINES[name] = cls
        return cls

    return wrap


def engine_class(name: str) -> type[Engine]:
    if name not in ENGINES and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in ENGINES:
        raise InvalidInput(f"unknown engine {name!r} (known: {', '.join(sorted(_BUILTIN))})")
    return ENGINES[name]


def import_object(ref: str) -> Any:
    """``package.module:attribute`` → the attribute (engine configs name factories so)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidInput(f"{ref!r} is not of the form 'package.module:callable'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise InvalidInput(f"cannot import {ref!r}: {exc}") from exc
    return obj
