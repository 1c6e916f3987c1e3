"""Wire schemas of the control API, named by purpose (``XCreate``, ``XUpdate``, ``XPublic``).

Every input schema forbids unknown fields, so a typo is a clear 422 instead of a silent
default.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from ember.domain.manifest import ManifestFile
from ember.domain.spec import ENGINE_OPTIONS
from ember.domain.trust import FACTORY_PATTERN
from ember.registry.tables import KeyScope, VersionStatus

NAME_PATTERN = r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$"
VERSION_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._+-]{0,61}[A-Za-z0-9])?$"
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
VersionName = Annotated[str, StringConstraints(pattern=VERSION_PATTERN)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
KNOWN_ENGINES = ("torch", "transformers", "vllm")
EngineName = Literal["torch", "transformers", "vllm"]
MAX_DOCUMENT_BYTES = 64 * 1024


def _bounded_json(value: Any) -> Any:
    if value is not None and len(json.dumps(value)) > MAX_DOCUMENT_BYTES:
        raise ValueError(f"must be at most {MAX_DOCUMENT_BYTES} bytes of JSON")
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(_bounded_json)]


class Input(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Public(BaseModel):
    model_config = ConfigDict(from_attributes=True)


T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = Field(
        None, description="Pass as `cursor` to get the next page; null on the last page."
    )


# --- tenants and keys -------------------------------------------------------------------


class TenantQuotas(Input):
    """Per-tenant overrides of the ``EMBER_QUOTA_*`` defaults; a field left out (or null)
    takes the default."""

    replicas: int | None = Field(
        None, ge=0, le=100_000, description="Hot + warm + standby replicas."
    )
    gpus: int | None = Field(None, ge=0, le=100_000, description="GPUs held by replicas.")
    cpu_cores: float | None = Field(None, ge=0, le=1_000_000, description="CPU cores of replicas.")
    memory_gib: float | None = Field(None, ge=0, le=10_000_000, description="Memory of replicas.")
    queued_jobs: int | None = Field(None, ge=0, le=100_000_000, description="Unfinished jobs.")
    job_bytes: int | None = Field(
        None, ge=0, le=2**62, description="Stored job inputs and results."
    )
    batch_runs: int | None = Field(None, ge=0, le=100_000, description="Batch runs in flight.")
    requests_per_s: float | None = Field(
        None, gt=0, le=1_000_000, description="Control-plane requests per second per key."
    )


class TenantCreate(Input):
    name: Name
    trusted: StrictBool = False
    quotas: TenantQuotas = Field(default_factory=TenantQuotas)


class TenantUpdate(Input):
    """Admin only. ``trusted``: the tenant may name engine factories beyond
    ``EMBER_ENGINE_FACTORIES``; ``quotas``: replaces the tenant's overrides."""

    trusted: StrictBool | None = None
    quotas: TenantQuotas | None = None


class TenantPublic(Public):
    name: str
    created_at: datetime
    trusted: bool = False
    quotas: TenantQuotas = Field(default_factory=TenantQuotas)

    @field_validator("quotas", mode="before")
    @classmethod
    def _no_overrides(cls, value: Any) -> Any:
        return {} if value is None else value


class ApiKeyCreate(Input):
    name: Name = "default"
    tenant: Name | None = Field(None, description="Tenant of the key; default: your own.")
    scope: KeyScope = KeyScope.tenant


class ApiKeyPublic(Public):
    id: int
    name: str
    tenant: str
    scope: KeyScope
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


class ApiKeyCreated(ApiKeyPublic):
    key: str = Field(description="The secret key. Shown once: store it now.")


# --- models and versions ----------------------------------------------------------------


class ModelCreate(Input):
    name: Name
    description: Annotated[str, StringConstraints(max_length=1000)] = ""


class ModelPublic(Public):
    name: str
    description: str
    created_at: datetime
    version_count: int = 0
    latest_version: str | None = None


class ModelVersionCreate(Input):
    version: VersionName
    artifact_uri: Annotated[str, StringConstraints(min_length=6, max_length=2048)] = Field(
        description="A `.safetensors` file, or a directory (ending in `/`: every file of a "
        "checkpoint, e.g. shards, index, config and tokenizer) in an allowed store location."
    )
    engine: EngineName
    engine_config: JsonObject = Field(default_factory=dict)
    input_schema: JsonObject | None = None
    output_schema: JsonObject | None = None
    sha256: Sha256 | None = Field(
        None,
        description="Expected digest (a directory's: its manifest's, `Manifest.digest`); "
        "registration fails if the artifact's differs.",
    )

    @model_validator(mode="after")
    def _engine_config(self) -> ModelVersionCreate:
        check_engine_config(self.engine, self.engine_config)
        return self


class CostModelPublic(Input):
    """``cost = alpha*in + beta*out + gamma`` model units; capacity in units per second."""

    alpha: float = Field(ge=0, le=1e6)
    beta: float = Field(ge=0, le=1e6)
    gamma: float = Field(ge=0, le=1e6)
    capacity_units_per_s: float = Field(gt=0, le=1e12)


def check_engine_config(engine: str, config: dict[str, Any]) -> None:
    """What can be checked without importing the engine (the control plane stays
    torch-free): the engine's own keys only, of the right types. Which code it may name
    (factories, vLLM flags) depends on the tenant: ``ember.domain.trust``, at the route."""
    if engine == "torch" and not (
        isinstance(config.get("factory"), str) and FACTORY_PATTERN.fullmatch(config["factory"])
    ):
        raise ValueError('the torch engine needs engine_config.factory: "package.module:callable"')
    if engine == "transformers" and config.get("task", "embedding") not in (
        "embedding",
        "classification",
    ):
        raise ValueError("transformers engine_config.task must be embedding or classification")
    options = ENGINE_OPTIONS.get(engine)
    if options is None:
        return
    try:
        options.model_validate(config)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        where = f"engine_config.{where}" if where else "engine_config"
        message = first.get("msg", "invalid")
        if first.get("type") == "extra_forbidden":
            known = ", ".join(options.model_fields)
            message = f"not a {engine} engine_config key (known: {known})"
        raise ValueError(f"{where}: {message}") from None


class ModelVersionPublic(Public):
    model: str
    version: str
    artifact_uri: str
    engine: str
    engine_config: dict[str, Any]
    input_schema: dict[str, Any] | None
    output_schema: dict[str, Any] | None
    status: VersionStatus
    status_reason: str | None
    sha256: str | None
    """The weights' digest; a directory version's manifest digest (its identity)."""
    size_bytes: int | None
    tensor_count: int | None
    files: list[ManifestFile] | None = None
    """The version's manifest: every file with its size and sha256 (a directory version's
    whole directory; a single-file version's weights and the sidecars beside them)."""
    cost_models: dict[str, CostModelPublic] = Field(default_factory=dict)
    created_at: datetime
    validated_at: datetime | None


# --- deployments ------------------------------------------------------------------------


MAX_SAFE_DEFAULT_BYTES = 16_384


class Placement(Input):
    """Where and how big each replica runs: on Kubernetes its node, GPUs and resources;
    on the local backend its threads, and ``gpus`` whole devices of the host where
    ``accelerator`` is set (``ember.pools.backends.local``)."""

    accelerator: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$",
        description="GPU type: pods go to nodes labelled `ember.dev/accelerator=<this>` and "
        "tolerate the `nvidia.com/gpu` taint (e.g. `nvidia-l40s`); null: CPU nodes.",
    )
    gpus: int = Field(1, ge=0, le=16, description="GPUs per replica when `accelerator` is set.")
    cpu_cores: float = Field(2.0, gt=0, le=256, description="CPU request and limit per replica.")
    memory_gib: float = Field(8.0, gt=0, le=4096, description="Memory request and limit.")
    threads: int | None = Field(
        None,
        ge=1,
        le=256,
        description="The model's intra-op (OpenMP) threads per replica; null: `cpu_cores` "
        "rounded up on Kubernetes, the process's CPU quota or affinity on the local backend.",
    )


class CapacitySchedule(Input):
    """Capacity held for a known event (a launch, a daily report): from each cron fire time
    for ``duration_s``, at least ``min_hot`` hot and ``min_warm`` warm replicas. The
    autoscaler applies each floor ahead by the promotion time of the tier that fills it,
    so the replicas are ready when the event starts."""

    cron: str = Field(max_length=255, description="5-field cron: when the event starts.")
    timezone: str = Field("UTC", max_length=64, description="IANA zone, e.g. Europe/Paris.")
    duration_s: float = Field(3600.0, gt=0, le=7 * 86_400, description="How long it lasts.")
    min_hot: int = Field(0, ge=0, le=1000)
    min_warm: int = Field(0, ge=0, le=1000)

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            if not value or value.startswith(("/", ".")) or ".." in value:
                raise ValueError
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
            raise ValueError(f"unknown IANA time zone {value!r} (e.g. UTC, Europe/Paris)") from exc
        return value

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str) -> str:
        from croniter import croniter

        if len(value.split()) != 5 or not croniter.is_valid(value):
            raise ValueError(
                f"cron expression {value!r} must be 5 valid fields (minute hour day month weekday)"
            )
        return value


class PoolPolicy(Input):
    """How a deployment's replica pool behaves. Every field has a safe default."""

    min_hot: int = Field(1, ge=0, le=1000, description="Replicas kept hot (weights on device).")
    scale_to_zero: bool = Field(
        False, description="Explicit opt-out of the warm floor; required for min_hot = 0."
    )
    max_replicas: int = Field(4, ge=1, le=1000)
    target_utilization: float = Field(0.7, gt=0, le=1)
    max_batch_size: int = Field(32, ge=1, le=4096)
    max_queue_delay_ms: float = Field(5, ge=0, le=10_000)
    timeout_ms: int = Field(30_000, ge=1, le=600_000)
    priority: int = Field(50, ge=0, le=100, description="Higher wins when capacity is short.")
    cache_ttl_s: float = Field(
        0, ge=0, le=86_400, description="Response cache TTL (jittered); 0 = no response cache."
    )
    cache_stale_s: float = Field(
        0,
        ge=0,
        le=7 * 86_400,
        description="How long past its TTL a cached answer may still serve as the "
        "degradation ladder's `cache` rung; 0 = no stale answers.",
    )
    safe_default: Any = Field(
        None,
        description="The ladder's last rung: this JSON value answers every instance when the "
        "model, the cache and the fallback versions cannot; null = no default rung.",
    )
    log_payloads: bool = Field(
        False, description="Write inputs and outputs, not only digests, to the prediction log."
    )
    hedge: bool = Field(
        False,
        description="Send a second copy of a request still unanswered after the version's p95 "
        "latency to another replica (within the retry budget) and take the first answer.",
    )
    placement: Placement = Field(
        default_factory=Placement,
        description="GPU type and resources of each replica on Kubernetes; its threads, and "
        "`gpus` whole GPUs of the host where `accelerator` is set, on the local backend too.",
    )
    schedules: list[CapacitySchedule] = Field(
        default_factory=list,
        max_length=16,
        description="Scheduled capacity for known events (cron, time zone, duration, "
        "`min_hot`, `min_warm`), staged ahead by the promotion time of the tier it fills.",
    )

    @property
    def hot_floor(self) -> int:
        """Hot replicas the pools controller keeps at least: ``min_hot``, and at least one
        unless the deployment opted out (``scale_to_zero``)."""
        return self.min_hot if self.scale_to_zero else max(self.min_hot, 1)

    @field_validator("safe_default")
    @classmethod
    def _small_default(cls, value: Any) -> Any:
        if value is not None and len(json.dumps(value)) > MAX_SAFE_DEFAULT_BYTES:
            raise ValueError(f"safe_default exceeds {MAX_SAFE_DEFAULT_BYTES} bytes of JSON")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> PoolPolicy:
        if self.min_hot == 0 and not self.scale_to_zero:
            raise ValueError("min_hot = 0 scales the model to zero: set scale_to_zero = true")
        if self.min_hot > self.max_replicas:
            raise ValueError(f"min_hot ({self.min_hot}) exceeds max_replicas ({self.max_replicas})")
        for sched in self.schedules:
            if sched.min_hot + sched.min_warm > self.max_replicas:
                raise ValueError(
                    f"schedule {sched.cron!r}: min_hot + min_warm exceeds max_replicas "
                    f"({self.max_replicas})"
                )
        return self


POLICY_FIELDS = tuple(PoolPolicy.model_fields)


class DeploymentCreate(PoolPolicy):
    name: Name | None = Field(None, description="Default: the model's name.")
    model: Name
    version: VersionName = Field(description="The version that serves as `production`.")
    fallback: list[VersionName] = Field(default_factory=list, max_length=8)


class DeploymentUpdate(Input):
    """Pool policy and fallback changes; routing changes go through canary/promote/rollback."""

    min_hot: int | None = Field(None, ge=0, le=1000)
    scale_to_zero: bool | None = None
    max_replicas: int | None = Field(None, ge=1, le=1000)
    target_utilization: float | None = Field(None, gt=0, le=1)
    max_batch_size: int | None = Field(None, ge=1, le=4096)
    max_queue_delay_ms: float | None = Field(None, ge=0, le=10_000)
    timeout_ms: int | None = Field(None, ge=1, le=600_000)
    priority: int | None = Field(None, ge=0, le=100)
    cache_ttl_s: float | None = Field(None, ge=0, le=86_400)
    cache_stale_s: float | None = Field(None, ge=0, le=7 * 86_400)
    safe_default: Any = Field(None, description="null removes the default rung.")
    log_payloads: bool | None = None
    hedge: bool | None = None
    placement: Placement | None = None
    schedules: list[CapacitySchedule] | None = Field(None, max_length=16)
    fallback: list[VersionName] | None = Field(None, max_length=8)


class CanaryRequest(Input):
    version: VersionName
    weight: int = Field(10, ge=1, le=99, description="Percent of traffic for the canary.")


class PromoteRequest(Input):
    version: VersionName | None = Field(None, description="Default: the current canary.")


class DeploymentPublic(PoolPolicy):
    model_config = ConfigDict(extra="ignore")

    name: str
    model: str
    traffic: dict[str, int]
    aliases: dict[str, str]
    fallback: list[str]
    revision: int
    created_at: datetime
    updated_at: datetime


class RevisionPublic(Public):
    revision: int
    traffic: dict[str, int]
    aliases: dict[str, str]
    reason: str
    created_at: datetime
