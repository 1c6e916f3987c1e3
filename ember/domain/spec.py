"""What a replica serves: a model version, resolved from the registry. Torch-free."""

from __future__ import annotations

import enum
from functools import cached_property
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from ember.costmodel import CostModel
from ember.domain.manifest import Manifest, ManifestFile
from ember.errors import ArtifactError

REPLICA_SECRET_ENV = "EMBER_REPLICA_SECRET"  # noqa: S105 (a name, not a secret)
"""The environment variable a replica process reads its secret from (made at launch by the
replica backend, never logged, never in argv); ``ember engine`` removes it at start."""
REPLICA_SECRET_HEADER = "X-Ember-Replica-Secret"  # noqa: S105
"""The header every call to a replica's API carries but liveness and readiness probes."""


def replica_auth(secret: str) -> dict[str, str]:
    """``{REPLICA_SECRET_HEADER: secret}``, or no header for a replica without a secret."""
    return {REPLICA_SECRET_HEADER: secret} if secret else {}


class Tier(enum.StrEnum):
    """What is alive in a replica (DESIGN.md, "Replica tiers")."""

    hot = "hot"
    """Weights on the device: serving."""
    warm = "warm"
    """Weights in host RAM: one host-to-device copy from hot."""
    standby = "standby"
    """Runtime imported, no weights: one load from the NVMe cache from hot."""


class Source(enum.StrEnum):
    """Where a replica becomes hot from: a live tier below hot, or ``cold`` — nothing
    alive, a new process. Not a :class:`Tier` (nothing of a cold replica exists to hold
    one); the autoscaler stages its forecasts by it and the controller learns how long a
    promotion from each takes."""

    warm = "warm"
    standby = "standby"
    cold = "cold"


class ReplicaState(enum.StrEnum):
    """Where a replica is in its lifecycle, as the pools controller tracks it (the values
    are what ``GET /v1/deployments/{name}/replicas`` shows)."""

    starting = "starting"
    """Launched (or assigned from the standby pool), not ready yet."""
    queued = "queued"
    """Starting, but the backend holds it back (waiting for GPUs): listings only."""
    ready = "ready"
    """Serving (hot) or holding its weights (warm)."""
    standby = "standby"
    """A process of the shared standby pool: runtime up, no version."""
    promoting = "promoting"
    """Being moved warm -> hot."""
    demoting = "demoting"
    """Being moved hot -> warm."""
    draining = "draining"
    """Being stopped: finishes what it holds, takes nothing new."""
    failed = "failed"


class DeploymentKey(NamedTuple):
    """A deployment, by its tenant and its name (a plain tuple on the wire and in maps)."""

    tenant_id: int
    name: str

    @property
    def standby_pool(self) -> bool:
        """The key of the shared standby pool (:data:`STANDBY_POOL`), no deployment."""
        return self == STANDBY_POOL


STANDBY_POOL = DeploymentKey(0, "")
"""The key of the processes of the shared standby pool: they belong to no deployment."""


class Priority(enum.IntEnum):
    """Request classes, highest first; lower numbers are served first."""

    health = 0
    online = 1
    async_ = 2
    batch = 3

    @classmethod
    def parse(cls, name: str) -> Priority:
        key = "async_" if name == "async" else name
        try:
            return cls[key]
        except KeyError:
            raise ValueError(
                f"priority must be one of online, async, batch (got {name!r})"
            ) from None

    @classmethod
    def requested(cls, label: str | None) -> Priority:
        """The class a request asks for (default ``online``); ``health`` is for probes."""
        priority = cls.parse(label or "online")
        if priority is cls.health:
            raise ValueError("the health class is reserved for probes")
        return priority

    @property
    def label(self) -> str:
        return "async" if self is Priority.async_ else self.name


class VersionSpec(BaseModel):
    """Everything a replica needs to serve one version (sent by the pools controller)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    version: str
    artifact_uri: str
    sha256: str
    engine: str
    engine_config: dict[str, Any] = Field(default_factory=dict)
    input_schema: dict[str, Any] | None = None
    output_schema: dict[str, Any] | None = None
    cost: dict[str, float] | None = None
    """Calibrated ``CostModel`` fields for this hardware, if known."""
    files: tuple[ManifestFile, ...] | None = None
    """The version's files (``ember.domain.manifest``). A directory version
    (``artifact_uri`` ending in ``/``): every file, and ``sha256`` is the manifest's digest.
    A single-file version: the weights and the sidecars registered beside them. None: a
    single-file version registered before manifests (its sidecars are read unverified)."""
    trusted: bool = False
    """The version's tenant is marked trusted (set by the pools controller from the
    registry): its code need not match the replica's ``EMBER_ENGINE_FACTORIES`` nor its
    vLLM flags the allowlist (``ember.domain.trust``). False: the replica checks both."""

    @property
    def directory(self) -> bool:
        """A multi-file version (a manifest of a directory), not one ``.safetensors``."""
        return self.artifact_uri.endswith("/")

    @cached_property
    def manifest(self) -> Manifest | None:
        """A directory version's manifest, checked against its ``sha256`` (a spec whose
        files are not the registered ones is refused before anything is read)."""
        if not self.directory:
            return None
        if not self.files:
            raise ArtifactError(f"directory version {self.model}:{self.version} has no manifest")
        manifest = Manifest.of(self.files)
        if manifest.digest != self.sha256:
            raise ArtifactError(
                f"the manifest of {self.model}:{self.version} does not match its sha256"
            )
        return manifest

    @cached_property
    def cost_model(self) -> CostModel:
        """Built once: the scheduler prices every queued instance with it."""
        return CostModel.from_dict(self.cost)


class BatchPolicy(BaseModel):
    """The replica's scheduling limits (from the deployment's pool policy)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(32, ge=1, le=4096)
    max_queue_delay_ms: float = Field(5.0, ge=0, le=10_000)
    max_queue: int = Field(1024, ge=1, description="Queued instances per priority class.")
    max_input_size: int = Field(8192, ge=1, description="Tokens / elements per instance.")
    max_batch_units: int = Field(65536, ge=1, description="Input size summed over a batch.")
    default_timeout_ms: int = Field(30_000, ge=1)


# --- engine_config, per engine (checked at registration and again in the replica) ---------


class TorchOptions(BaseModel):
    """The ``engine_config`` of a torch version: ``{"factory": "pkg.module:callable",
    "kwargs": {...}}``. Which factories may be named: ``ember.domain.trust``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    factory: str = Field(max_length=512)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the factory (plain JSON)."""


class TransformersOptions(BaseModel):
    """The ``engine_config`` of a transformers version (no remote code, ever)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: Literal["embedding", "classification"] = "embedding"
    max_length: int = Field(256, ge=1, le=1_000_000)
    """Tokens per text the model sees (longer texts are truncated)."""


class VllmOptions(BaseModel):
    """The ``engine_config`` of a vLLM version."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_model_len: int | None = Field(None, ge=16, le=10_000_000)
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] | None = None
    """Default: ``float32`` on CPU (bf16 kernels crash without AMX permission), else auto."""
    kv_cache_bytes: int | None = Field(None, ge=1024 * 1024, le=2**50)
    """KV cache size; default on CPU 256 MiB (vLLM would take 90 % of RAM)."""
    enforce_eager: bool | None = None
    """Default: true on CPU (no torch.compile: starts in tens of seconds, not minutes)."""
    max_num_seqs: int | None = Field(None, ge=1, le=1_000_000)
    max_tokens: int = Field(16, ge=1, le=10_000_000)
    """Default completion length for ``/infer`` instances that do not say."""
    vllm_args: dict[str, Any] = Field(default_factory=dict)
    """Further ``vllm serve`` flags, without the leading dashes (``true`` = the flag,
    ``false`` = its ``--no-`` form): vLLM's tuning flags only (``ember.domain.trust``)."""


ENGINE_OPTIONS: dict[str, type[BaseModel]] = {
    "torch": TorchOptions,
    "transformers": TransformersOptions,
    "vllm": VllmOptions,
}
"""The ``engine_config`` schema of each engine a version may name."""
