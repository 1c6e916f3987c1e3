"""Model units: what one request costs a replica, and how many units a replica serves/s.

``cost = alpha * input_size + beta * output_size + gamma`` — tokens for language models,
rows x elements for tensor models. The engine's calibration fits the coefficients per
model version and hardware; the registry stores them; admission, the router and the
autoscaler read them. Torch-free: the control plane imports this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class CostModel:
    alpha: float = 0.0
    """Units per input token / element."""
    beta: float = 0.0
    """Units per output token / element."""
    gamma: float = 1.0
    """Fixed units per request."""
    capacity_units_per_s: float = 1.0
    """Units one replica completes per second at its best batch size."""

    def cost(self, input_size: float, output_size: float = 0.0) -> float:
        return self.alpha * input_size + self.beta * output_size + self.gamma

    def service_s(self, input_size: float, output_size: float = 0.0) -> float:
        """Seconds of one replica's capacity the request takes."""
        return self.cost(input_size, output_size) / self.capacity_units_per_s

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> CostModel:
        if not data:
            return cls()
        return cls(**{k: float(data[k]) for k in cls.__dataclass_fields__ if k in data})


#: Requests are one unit each until a version is calibrated.
UNCALIBRATED = CostModel()


def fit(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least-squares ``(alpha, beta, gamma)`` from ``(input, output, seconds)`` samples,
    clamped at zero (a negative per-token cost is measurement noise, not physics).

    Seconds are the unit: one model unit is one second of a replica's time at batch 1.
    """
    if len(samples) < 3:
        raise ValueError("need at least 3 samples to fit alpha, beta and gamma")
    # Normal equations for [in, out, 1] @ [a, b, g] = seconds, solved without numpy.
    rows = [(float(i), float(o), 1.0) for i, o, _ in samples]
    ys = [float(s) for _, _, s in samples]
    ata = [[sum(r[p] * r[q] for r in rows) for q in range(3)] for p in range(3)]
    aty = [sum(r[p] * y for r, y in zip(rows, ys, strict=True)) for p in range(3)]
    # A size that never varies (fixed-shape tensor models, no outputs) cannot be told apart
    # from the fixed cost: fold it into gamma.
    active = [p for p in range(2) if len({r[p] for r in rows}) > 1] + [2]
    solution = _solve([[ata[p][q] for q in active] for p in active], [aty[p] for p in active])
    coef = [0.0, 0.0, 0.0]
    for p, value in zip(active, solution, strict=True):
        coef[p] = max(0.0, value)
    return coef[0], coef[1], coef[2]


def hardware_key(device: str, accelerator_name: str | None = None) -> str:
    """Which calibration applies: ``cpu-<n>c`` or ``cuda-<device name>``."""
    import os

    if device.startswith("cuda") and accelerator_name:
        return "cuda-" + accelerator_name.replace(" ", "-").lower()
    return f"cpu-{len(os.sched_getaffinity(0))}c"


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            raise ValueError("samples do not determine the cost model (vary the sizes)")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                factor = m[r][col] / m[col][col]
                m[r] = [x - factor * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]
