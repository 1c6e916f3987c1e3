"""``LoadReport``: what one load moved, how fast, and whether the cache served it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ember.logs import get_logger

log = get_logger(__name__)

CacheOutcome = Literal["hit", "verified-hit", "miss", "resumed", "refetched", "bypass"]


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    """``fetch`` (store -> cache, placing as it goes), ``verify`` (re-hash on a hit),
    ``place`` (cache file -> device), ``total``."""
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(slots=True)
class LoadReport:
    model: str | None
    version: str | None
    source: str
    sha256: str | None
    device: str
    cache: CacheOutcome
    bytes: int = 0
    """Bytes of tensor data placed on the device."""
    tensors: int = 0
    bytes_fetched: int = 0
    """Bytes read from the object store (0 on a cache hit)."""
    stages: list[Stage] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return next((s.seconds for s in self.stages if s.name == "total"), 0.0)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def stage(self, name: str, nbytes: int, seconds: float) -> None:
        self.stages.append(Stage(name, nbytes, seconds))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["stages"] = [{**asdict(s), "gbps": round(s.gbps, 3)} for s in self.stages]
        out["seconds"], out["gbps"] = round(self.seconds, 4), round(self.gbps, 3)
        return out

    def log(self) -> None:
        """One INFO line; inside ``model_context`` it carries model and version."""
        log.info(
            "weights loaded", source=self.source, sha256=self.sha256, device=self.device,
            cache=self.cache, bytes=self.bytes, tensors=self.tensors,
            bytes_fetched=self.bytes_fetched, seconds=round(self.seconds, 4),
            gbps=round(self.gbps, 3),
            **{f"{s.name}_gbps": round(s.gbps, 3) for s in self.stages if s.name != "total"},
            **{f"{s.name}_s": round(s.seconds, 4) for s in self.stages if s.name != "total"},
        )  # fmt: skip
