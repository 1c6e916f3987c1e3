"""``synthetic`` engine: known costs, no weights. Each forward pass sleeps
``gamma + sum(alpha * in + beta * out)`` seconds — what calibration must recover.

engine_config: ``{"alpha": 0.0001, "beta": 0.001, "gamma": 0.01}``; instances are
``{"in": int, "out": int}``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ember.domain.spec import Tier
from ember.engine.base import Engine, Sized, register_engine
from ember.errors import InvalidInput


@register_engine("synthetic")
class SyntheticEngine(Engine):
    def load(self) -> None:
        self.tier = Tier.hot

    def _coef(self, name: str) -> float:
        return float(self.spec.engine_config.get(name, 0.0))

    def prepare(self, instance: Any) -> Sized:
        if not isinstance(instance, dict) or not all(
            isinstance(instance.get(k, 0), int) for k in ("in", "out")
        ):
            raise InvalidInput('synthetic instances are {"in": int, "out": int}')
        return Sized(instance, int(instance.get("in", 0)), int(instance.get("out", 0)))

    def forward(self, batch: Sequence[Any]) -> list[Any]:
        alpha, beta, gamma = self._coef("alpha"), self._coef("beta"), self._coef("gamma")
        time.sleep(gamma + sum(alpha * i.get("in", 0) + beta * i.get("out", 0) for i in batch))
        return [{"ok": True} for _ in batch]

    def probe(self) -> Any:
        return {"in": 1, "out": 0}

    def sample(self, input_size: int, output_size: int = 0) -> Any:
        return {"in": input_size, "out": output_size}
