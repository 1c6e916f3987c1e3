"""Ember settings: one typed object, read from ``EMBER_*`` environment variables.

Every field here is documented, with its default, in the manual's settings reference
(docs/reference/settings.md), which the site's build generates from this class.
Build one ``Settings`` at process start (``get_settings()``), validate it, and hand the
pieces down; nothing reads the environment anywhere else.
"""

from __future__ import annotations

import os
from difflib import get_close_matches
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import unquote, urlparse

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_WEAK_KEYS = {"changethis", "changeme", "admin", "password", "secret"}


def _split_csv(value: object) -> object:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="EMBER_",
        extra="forbid",
        validate_default=True,
        frozen=True,
        use_attribute_docstrings=True,
    )

    data_dir: Path = Path(".ember")
    """Root of everything Ember keeps on one machine: SQLite registry, object store, cache."""
    host: str = "127.0.0.1"
    """Address the API binds to."""
    port: int = Field(8000, ge=1, le=65535)
    """Port the API listens on."""
    admin_key: SecretStr | None = None
    """Admin API key taken on first start; generated and printed once when unset."""

    database_url: str | None = None
    """SQLAlchemy URL of the registry. Default: ``sqlite:///<data_dir>/registry.db``."""
    redis_url: str | None = None
    """Redis for the job queue and shared caches. Unset: ``ember up`` starts a local one."""
    local_redis_port: int = Field(6390, ge=1, le=65535)
    """Port on ``127.0.0.1`` of the data directory's own Redis that ``ember up`` starts
    when ``EMBER_REDIS_URL`` is unset (one already running for the data directory is used
    where it is). Set: tried first; unset: the port that Redis had last time
    (``<data_dir>/redis/port``), else 6390. Taken by anything but this data directory's
    Redis (another data directory's, say): a free port instead."""

    object_store_url: str | None = None
    """Where ``ember models push`` puts artifacts (``file://`` or ``s3://bucket/prefix``).
    Default: ``file://<data_dir>/objects``."""
    file_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    """Extra directories ``file://`` artifact URIs may point into (comma-separated);
    the object store directory is always allowed."""
    s3_allowed_buckets: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Buckets ``s3://`` artifact URIs may name (comma-separated); the object store's
    bucket is always allowed, ``*`` allows any."""
    s3_endpoint_url: str | None = None
    """S3-compatible endpoint (moto, MinIO); unset for AWS."""
    s3_region: str = "us-east-1"
    """Region for the S3 client."""
    s3_part_size_bytes: int = Field(8 * 1024 * 1024, ge=5 * 1024 * 1024)
    """Part size of multipart uploads and ranged GETs."""
    s3_max_concurrency: int = Field(8, ge=1, le=64)
    """Parallel S3 requests per transfer."""
    s3_max_attempts: int = Field(5, ge=1, le=20)
    """Attempts per S3 request on throttling / 5xx (exponential backoff with jitter)."""

    cache_dir: Path | None = None
    """NVMe weight cache. Default: ``<data_dir>/cache``."""
    cache_max_bytes: int = Field(20 * 1024**3, ge=0)
    """Byte budget of the weight cache (LRU eviction beyond it)."""

    max_request_bytes: int = Field(10 * 1024 * 1024, ge=1024)
    """Largest request body the API accepts (413 beyond)."""
    artifact_max_header_bytes: int = Field(100 * 1024 * 1024, ge=1024)
    """Largest safetensors JSON header Ember will read."""
    validate_inline_max_bytes: int = Field(64 * 1024 * 1024, ge=0)
    """Artifacts up to this size are validated before registration returns; larger
    ones validate in the background (status ``pending`` until done)."""
    manifest_max_files: int = Field(4096, ge=1, le=100_000)
    """Most files a directory version may hold (its manifest); a larger directory is
    refused at registration."""

    pools_enabled: bool = True
    """Run the pools controller (replicas for every deployment) in the API process."""
    standby_replicas: int = Field(1, ge=0, le=64)
    """Standby processes (runtime imported, no weights) kept ready for fast scale-ups: the
    pool's floor (0 turns the pool off)."""
    standby_max_replicas: int = Field(4, ge=0, le=64)
    """The pool grows from the floor with the starts it has served: one more than the most
    asked for within one process start time (learned), as ``ember simulate`` sizes it,
    never beyond this. At or below the floor: a fixed pool."""
    standby_reserve_max_bytes: int = Field(2 * 1024**3, ge=0)
    """Local standby processes fault in host memory ahead for the weights they may be
    given: as much as the largest version a deployment serves (whose replicas a standby
    process can become), at most this; 0 turns it off. A load's first touch of fresh
    memory is otherwise part of the cold start (slow where a virtual machine hands freed
    memory back to its host). The memory is held while the process waits; a process
    reserves nothing when it would take more than half of the memory available."""
    probe_idle_s: float = Field(5.0, gt=0)
    """Probe a ready replica's ``/healthz`` when it answered nothing for this long."""
    probe_timeout_s: float = Field(2.0, gt=0)
    """A probe slower than this counts as failed."""
    probe_failures: int = Field(2, ge=1)
    """Consecutive failed probes before a replica is killed and replaced."""
    scale_idle_hold_s: float = Field(10.0, gt=0, le=86_400)
    """No requests for this long: a deployment's hot replicas above its ``min_hot`` floor
    are demoted to warm (one tier at a time)."""
    scale_warm_keep_s: float = Field(600.0, gt=0, le=7 * 86_400)
    """A ``scale_to_zero`` deployment keeps one warm replica this long after its last
    request (longer where its daily profile expects requests); then it holds none, and
    the next request wakes it (from a standby process where one is free)."""
    scale_fill_warm: bool = False
    """Start replicas straight into the warm tier (loaded, then demoted) when the autoscaler
    wants more warm ones than demoting hot ones gives, as ``ember simulate`` assumes. Off by
    default: on CPU a warm replica holds as much memory as a hot one (on a GPU it frees the
    device memory)."""
    scale_warm_cost: float = Field(0.1, ge=0, le=1)
    """What a warm replica costs next to a hot one on this hardware (1 = as much): the
    autoscaler keeps a warm buffer only where it is cheaper than hot. 0.1 where released
    devices serve other models; 1.0 where a warm replica keeps its GPU (then the capacity
    a forecast needs is kept hot, started one cold start ahead, and no warm spares)."""
    scale_standby_cost: float = Field(0.03, ge=0, le=1)
    """What a standby replica costs next to a hot one (kept as a buffer only where it is
    cheaper than the tier above it)."""
    scale_forecast_quantile: float = Field(0.8, ge=0.5, lt=1)
    """Each tier covers this quantile of the forecast demand at its horizon, not the mean
    (0.5: the mean)."""
    scale_profile_period_s: float = Field(86_400.0, ge=20, le=86_400)
    """Period of the autoscaler's daily profile (the weekly one is seven of them). Only
    tests and demos change it, to compress a day: the profile's bins (to no less than two
    ticks) and the autoscaler's memories (the demand's level and trend, a burst, a step
    down held; to no less than five ticks) shrink by the same factor."""
    warm_set_bytes: int = Field(4 * 1024**3, ge=0)
    """The shared warm tier (local backend): host RAM that holds the cached weights of
    versions with no hot or warm replica (most recently requested first), mapped and
    locked in the page cache, so a standby process promotes them from the page cache
    instead of reading the disk. 0 turns it off."""
    tenant_units_per_s: float = Field(10_000.0, gt=0)
    """Each tenant's admission budget in model units per second."""
    tenant_burst_units: float = Field(20_000.0, gt=0)
    """Each tenant's burst allowance in model units."""
    retry_budget_ratio: float = Field(0.1, ge=0, le=1)
    """Retries allowed per request on average (0.1: at most ~10 % of requests retried)."""
    vllm_executable: Path | None = None
    """The ``ember`` executable that runs vLLM replicas (a virtualenv with vLLM). Unset:
    ``.venv-vllm/bin/ember`` beside the API's virtualenv if it exists, else the API's own."""
    replica_backend: Literal["local", "kubernetes"] = "local"
    """Where the pools controller runs replicas: ``local`` processes on this machine, or
    ``kubernetes`` Deployments in ``EMBER_K8S_NAMESPACE`` (see "Running on Kubernetes")."""
    k8s_namespace: str = Field("ember", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    """Namespace of the replicas' Deployments and pods, and of the controller's Lease."""
    k8s_image: str | None = None
    """Container image of the replicas (the Ember image, e.g. the ECR repository URL with
    a tag). Required with ``EMBER_REPLICA_BACKEND=kubernetes``."""
    k8s_kubeconfig: Path | None = None
    """Kubeconfig file of the cluster. Unset: the in-cluster service account when running
    in a pod, else ``~/.kube/config``."""
    k8s_context: str | None = None
    """Kubeconfig context to use. Unset: the file's current context."""
    k8s_standby_accelerators: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["cpu"]
    )
    """Hardware types that keep standby pods (comma-separated GPU types, the nodes'
    ``ember.dev/accelerator`` label, or ``cpu``); each keeps ``EMBER_STANDBY_REPLICAS``."""
    k8s_standby_cpu_cores: float = Field(4.0, gt=0, le=256)
    """CPU request and limit of a standby pod; a version whose placement asks for more
    starts cold instead of taking one."""
    k8s_standby_memory_gib: float = Field(32.0, gt=0, le=4096)
    """Memory request and limit of a standby pod (likewise)."""
    k8s_service_account: str = "ember-engine"
    """Service account of the replica pods (its IRSA role reads the artifacts)."""
    k8s_config_map: str = "ember-config"
    """ConfigMap whose ``EMBER_*`` keys every replica pod gets (optional: may not exist)."""
    k8s_replica_port: int = Field(9000, ge=1, le=65535)
    """Container port of the replicas' internal API."""
    k8s_pending_timeout_s: float = Field(600.0, gt=0)
    """A replica pod not running after this long (no node with capacity, image not
    pulled) is reported failed with the pod's reason, counted, and replaced."""
    k8s_termination_grace_s: int = Field(60, ge=1, le=3600)
    """Grace a stopped replica pod has to finish in-flight requests before SIGKILL."""
    k8s_lease_name: str = Field("ember-pools", pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
    """Lease (``coordination.k8s.io/v1``) that elects the one acting pools controller among
    the API replicas."""
    k8s_lease_duration_s: float = Field(15.0, ge=2, le=300)
    """How long a leader's lease lasts without renewal; another API replica takes over
    after it (renewed every third of it)."""
    response_cache_entries: int = Field(4096, ge=0, le=10_000_000)
    """Entries of the in-process front of the response cache (Redis holds the rest);
    0 keeps every entry in Redis only."""
    response_cache_max_bytes: int = Field(1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    """Largest answer the response cache stores; bigger ones are served but not cached."""
    ladder_reserve: float = Field(0.25, ge=0, lt=1)
    """Share of a request's deadline kept back for the fallback version when a deployment
    has one (the model rung gets the rest)."""
    prediction_log_url: str | None = None
    """Where the prediction log goes: ``file:///dir`` (JSONL files rotated hourly and by
    size), ``s3://bucket/prefix`` (one object per window) or ``off``.
    Default: ``file://<data_dir>/predictions``."""
    prediction_log_backlog: int = Field(100_000, ge=1, le=10_000_000)
    """Records the prediction log holds while its sink is slow or down; beyond this it
    drops (counted in ``ember_prediction_log_dropped_total``), never blocks a request."""
    prediction_log_window_s: float = Field(60.0, gt=0, le=3600)
    """How often the prediction log flushes (one S3 object per window)."""
    prediction_log_file_bytes: int = Field(256 * 1024 * 1024, ge=4096)
    """A prediction log file rolls over at this size (and every hour)."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Lowest level logged."""
    log_format: Literal["auto", "json", "console"] = "auto"
    """``auto``: JSON when stderr is not a TTY, human-readable when it is."""

    # --- traces (ember.tracing) ---
    otel_endpoint: str | None = None
    """OTLP/HTTP collector that traces are exported to (``http://host:4318``; spans go to
    ``<endpoint>/v1/traces``). Unset: tracing is off (no exporter, no spans); a client's
    ``traceparent`` still reaches the log lines. Replicas inherit ``EMBER_OTEL_*`` but the
    headers."""
    otel_service_name: str | None = None
    """``service.name`` of this process's spans. Default: ``ember-api``, ``ember-engine``
    (a replica) or ``ember-worker``."""
    otel_sample_ratio: float = Field(1.0, ge=0, le=1)
    """Share of new traces recorded (chosen by trace id); a request with a caller's
    ``traceparent`` follows the caller's sampled flag."""
    otel_headers: SecretStr | None = None
    """Headers sent with every export, ``name=value`` pairs separated by commas (a hosted
    collector's API key). Never passed to replicas (they run tenants' code): point them at
    a collector that needs none, such as an agent on the host."""
    otel_export_delay_ms: int = Field(2000, ge=10, le=60_000)
    """How long finished spans are batched before they are sent."""
    otel_timeout_s: float = Field(10.0, gt=0, le=60)
    """Timeout of one export request to the collector."""

    @field_validator("otel_endpoint")
    @classmethod
    def _otel_endpoint(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        parsed = urlparse(value.strip())
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError("EMBER_OTEL_ENDPOINT must be an http:// or https:// URL")
        return value.strip()

    # --- loader ---
    s3_retry_base_s: float = Field(0.1, gt=0, le=10)
    """First backoff of an S3 read retry; doubles per attempt (full jitter)."""
    s3_retry_max_backoff_s: float = Field(5.0, gt=0, le=120)
    """Cap of one S3 read retry backoff."""
    cache_verify_after_s: float = Field(24 * 3600.0, ge=0)
    """A cache hit re-hashes the entry (sha256) before loading it when its last
    verification is older than this; 0 verifies on every hit."""
    cache_lock_timeout_s: float = Field(1800.0, gt=0)
    """How long a load waits for another thread or process filling the same entry."""
    loader_threads: int = Field(4, ge=1, le=64)
    """Parallel reads (and copies) when a local file is placed on the device."""
    loader_shards_in_flight: int = Field(4, ge=1, le=64)
    """Shards of a multi-file version loaded at once (each fetched or read in parallel
    parts of its own): a sharded checkpoint streams through the cache into the device as
    one pipeline."""
    loader_chunk_bytes: int = Field(16 * 1024 * 1024, ge=1024 * 1024, le=256 * 1024 * 1024)
    """Size of one read when a local file is placed on the device (rounded down to 4 KiB)."""
    loader_staging_bytes: int = Field(128 * 1024 * 1024, ge=8 * 1024 * 1024, le=1024**3)
    """Host staging memory per device, allocated and touched once, reused by every load
    (pinned on CUDA). At most 1 GiB."""
    loader_direct_io: bool = True
    """Read each chunk of a local file that the page cache does not hold whole with
    O_DIRECT into huge-page memory (where the filesystem allows it); cached chunks are
    always read through the page cache."""
    loader_map_resident: bool = True
    """On CPU, a cache entry the page cache holds whole (a version in the shared warm tier,
    or one a replica loaded before) is mapped instead of copied: the tensors are
    copy-on-write views of the page cache, shared by every replica of the version, and
    every page is mapped before the load returns. The replica then locks those pages in
    RAM (``mlock``, just after the load) while it holds the weights; where it may not lock
    memory they stay reclaimable, and an idle replica may read them from the disk again."""

    # --- async jobs (ember/jobs) ---
    jobs_api_url: str | None = None
    """Base URL where job workers call the gateway's data plane. Default:
    ``http://<host>:<port>`` (``127.0.0.1`` when the API binds every address)."""
    jobs_api_key: SecretStr | None = None
    """Worker key job and batch workers send, acting for each job's tenant
    (``X-Ember-Tenant``) on the data plane. ``ember up`` mints one for the worker it runs;
    set it for workers on other hosts (``ember keys create --worker``)."""
    jobs_worker_concurrency: int = Field(4, ge=1, le=256)
    """Jobs one ``ember worker`` process runs at once (threads; the work is HTTP calls)."""
    jobs_max_attempts: int = Field(5, ge=1, le=100)
    """Attempts per job on transient errors (5xx, replica unreachable, worker lost)
    before it fails with every attempt's error."""
    jobs_max_deferrals: int = Field(1000, ge=1)
    """Times a job may be shed (429: online traffic goes first) and re-queued before it
    fails; deferrals do not count as attempts."""
    jobs_retry_base_s: float = Field(1.0, gt=0, le=600)
    """First backoff of a job (or webhook) retry; doubles per attempt (full jitter)."""
    jobs_retry_max_backoff_s: float = Field(60.0, gt=0, le=3600)
    """Cap of one job (or webhook) retry backoff."""
    jobs_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """Longest one attempt of a job may run; the attempt fails (and is retried) beyond."""
    jobs_visibility_timeout_s: float = Field(3600.0, gt=0)
    """Redis visibility timeout: an unacknowledged job message is redelivered after this.
    Must exceed ``EMBER_JOBS_TIMEOUT_S``."""
    jobs_lease_s: float = Field(30.0, ge=1, le=3600)
    """A running job's lease, renewed by its worker; a job whose lease ran out (worker
    killed or hung) is taken over by another attempt."""
    jobs_sweep_interval_s: float = Field(5.0, gt=0, le=600)
    """How often a worker re-publishes lost job messages, takes over expired leases and
    purges expired results."""
    jobs_republish_after_s: float = Field(300.0, gt=0)
    """A queued job whose message was published this long ago without being picked up is
    published again (a safety net; duplicates are harmless)."""
    jobs_chunk_instances: int = Field(64, ge=1, le=10_000)
    """Instances per data-plane call a worker makes for a job (at most half the
    deployment's ``max_batch_size``, so the async class fits beside online traffic)."""
    jobs_inline_result_max_bytes: int = Field(64 * 1024, ge=0, le=16 * 1024 * 1024)
    """Results up to this size are kept in the registry; larger ones go to the object
    store under ``job-results/<tenant>/<model>/<version>/<job>/``."""
    jobs_max_input_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Largest ``input_uri`` object a job may name."""
    jobs_result_ttl_s: float = Field(7 * 86_400.0, gt=0)
    """How long a finished job's result and inputs are kept; then they are purged."""
    jobs_tenant_max_queued_units: float = Field(1_000_000.0, gt=0)
    """Model units of unfinished jobs a tenant may have; submissions beyond get 429."""
    jobs_tenant_max_queued_jobs: int = Field(10_000, ge=1)
    """Unfinished jobs a tenant may have (the default of its ``queued_jobs`` quota, which an
    admin may override per tenant); submissions beyond get 429."""
    jobs_webhook_allow_private: bool = False
    """Allow webhooks to loopback, private, link-local and other non-public addresses
    (off: such URLs are refused, SSRF)."""
    jobs_webhook_max_attempts: int = Field(8, ge=1, le=100)
    """Deliveries tried per webhook (backoff between them) before it is marked failed."""
    jobs_webhook_timeout_s: float = Field(10.0, gt=0, le=300)
    """Total time one webhook delivery may take (connect, send, the answer), however
    slowly the receiver drips its answer."""

    # --- batch scoring (ember/batch) ---
    batch_lease_s: float = Field(30.0, ge=1, le=3600)
    """A worker's lease on a batch shard, renewed in the background while it runs; an
    expired lease (the worker died) lets another worker take the shard over."""
    batch_sweep_interval_s: float = Field(5.0, gt=0, le=600)
    """How often each worker republishes batch shards whose lease expired or whose
    message was lost."""
    batch_beat_interval_s: float = Field(10.0, gt=0, le=600)
    """How often ``ember beat`` reads the schedules and fires those that are due."""
    batch_max_files: int = Field(10_000, ge=1)
    """Input files one batch run may match."""
    batch_max_attempts: int = Field(5, ge=1, le=100)
    """Attempts per shard before the shard (and its run) fails."""
    batch_direct: bool = True
    """Workers send a run's batches straight to the version's replicas (the gateway's
    ``:batch-lane`` names them), as tensor bodies with tensor answers; off, or while no
    replica is ready or reachable from the worker's host, through the gateway's
    ``:predict``."""

    # --- trust: the code a version may name (issue 20 §1) ---
    engine_factories: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [
            "ember.engine.examples.mlp:mlp",
            "ember.engine.examples.mlp:slow_mlp",
        ]
    )
    """Torch-engine factories every tenant may name (comma-separated ``fnmatch``
    patterns): one with a ``:`` matches the whole ``module:callable``
    (``mycorp.models:build_*``), one without the module path (``mycorp.models.*``). The
    callable must be one public name defined in that module. Default: Ember's example
    models. A tenant an admin marks trusted may name any importable factory. Replicas
    check it again at load: set it for them too."""
    vllm_args_allowed: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """``vllm serve`` flags (comma-separated, without dashes) a version's
    ``engine_config.vllm_args`` may set beyond Ember's tuning-flag allowlist, each with a
    scalar value; the flags Ember sets itself (``load-format``, ``model``, ...) never.
    Default: none."""

    @field_validator("engine_factories", "vllm_args_allowed", mode="before")
    @classmethod
    def _trust_csv(cls, value: object) -> object:
        return _split_csv(value)

    # --- replicas: least privilege and the replica API's secret (issue 20 §2, §3) ---
    replica_user: str = Field("auto", min_length=1, max_length=64)
    """The user local replicas run as. ``auto`` (default): where the API runs as root, each
    tenant's replicas run as uid ``EMBER_REPLICA_UID_BASE + tenant id`` (no passwd entry
    needed; a standby process drops to it on ``/assign``, before it reads anything of the
    version), unless a directory the replica needs (the interpreter, the virtualenv, the
    data directory, the cache) is not traversable by other users: then as root, with a
    warning. ``off``: the API's own user. A user name or uid: every replica runs as it, and
    a launch fails when it cannot reach what it needs."""
    replica_uid_base: int = Field(61000, ge=1000, le=2**31 - 2**24)
    """``EMBER_REPLICA_USER=auto``: tenant N's replicas run as this uid plus N."""
    replica_env_passthrough: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Extra environment variables (exact names, comma-separated) that local replica
    processes inherit besides the built-in allowlist (``ember.pools.backends.local``'s
    ``ENV_ALLOWLIST``). Default: none."""

    @field_validator("replica_env_passthrough", mode="before")
    @classmethod
    def _env_names(cls, value: object) -> object:
        return _split_csv(value)

    gpus: str = Field("auto", max_length=65_536)
    """The GPUs local replicas are given (each whole, to one replica at a time, as its
    ``CUDA_VISIBLE_DEVICES``). ``auto`` (default): the NVIDIA GPUs NVML finds (the MIG
    devices of a GPU in MIG mode), those the API's own ``CUDA_VISIBLE_DEVICES`` shows;
    none where there is no driver. ``none``: no GPUs. Or the devices themselves: ids as
    ``CUDA_VISIBLE_DEVICES`` takes them (``0,1``, ``GPU-<uuid>``, ``MIG-<uuid>``), or a
    JSON list ``[{"id": "0", "name": "NVIDIA L4", "memory_bytes": 23034593280}]``."""

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, value: str) -> str:
        from ember.domain.gpus import parse_setting

        parse_setting(value)  # ValueError names what is wrong
        return value

    # --- quotas and rate limits (issue 20 §6) ---
    # Each is the default of one per-tenant quota (``PATCH /v1/tenants/{name}`` overrides it).
    # The queued-jobs quota's default is ``EMBER_JOBS_TENANT_MAX_QUEUED_JOBS`` (async jobs).
    quota_replicas: int = Field(32, ge=0, le=100_000)
    """Replicas a tenant's deployments may hold at most (hot + warm + standby: each
    deployment counts its ``max_replicas``, plus its canary's and fallback versions' share);
    a deployment create or change beyond it gets 403."""
    quota_gpus: int = Field(8, ge=0, le=100_000)
    """GPUs a tenant's deployments may hold at most (``max_replicas`` x ``placement.gpus``
    where ``placement.accelerator`` is set), likewise."""
    quota_cpu_cores: float = Field(64.0, ge=0, le=1_000_000)
    """CPU cores a tenant's deployments may hold at most (``max_replicas`` x
    ``placement.cpu_cores``), likewise."""
    quota_memory_gib: float = Field(256.0, ge=0, le=10_000_000)
    """Memory (GiB) a tenant's deployments may hold at most (``max_replicas`` x
    ``placement.memory_gib``), likewise."""
    quota_job_bytes: int = Field(10 * 1024**3, ge=0, le=2**62)
    """Bytes of job inputs and results a tenant may keep stored (jobs not yet purged, see
    ``EMBER_JOBS_RESULT_TTL_S``); a job submitted beyond gets 403."""
    quota_batch_runs: int = Field(4, ge=0, le=100_000)
    """Batch runs a tenant may have running at once; a run started beyond gets 429 (a
    scheduled one is recorded as failed, refused by the quota)."""
    quota_requests_per_s: float = Field(50.0, gt=0, le=1_000_000)
    """Control-plane requests per second each tenant key may send (everything but the data
    plane: ``:predict``, the V2 and OpenAI routes, ``:batch-lane``), shared by every API
    process through Redis; beyond, 429 with ``Retry-After``. Admin keys are not limited."""
    quota_request_burst: float = Field(200.0, ge=1, le=10_000_000)
    """Requests a key may send at once above that rate. A tenant whose rate an admin
    overrides keeps the same burst window (this ÷ the rate, in seconds)."""

    # --- metrics, webhooks, the local Redis (issue 20 §7) ---
    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Serve ``/metrics`` on this port, bound to ``127.0.0.1``, without a key (and not on
    the API port). Unset (the default): ``/metrics`` is on the API port and needs a key (an
    admin key reads every series, a tenant key its own tenant's)."""
    engine_metrics_port: int | None = Field(None, ge=1, le=65535)
    """A replica (``ember engine``) serves its own ``/metrics`` on this port too, on every
    address and without the replica secret, for a Prometheus scrape (the Kubernetes backend
    sets it on replica pods from ``EMBER_K8S_REPLICA_METRICS_PORT``). Unset (the default):
    only on the replica port, with the secret."""
    k8s_replica_metrics_port: int | None = Field(9090, ge=1, le=65535)
    """The port of a replica pod's own ``/metrics`` (no secret; the ``metrics`` container
    port, with ``prometheus.io/*`` scrape annotations; deploy/k8s/monitoring admits only the
    scraper to it). Unset: replica pods expose no metrics port."""
    jobs_webhook_max_response_bytes: int = Field(4096, ge=0, le=1_048_576)
    """Bytes of a webhook receiver's answer read (the rest is not); default 4 KiB."""

    @field_validator("file_roots", "s3_allowed_buckets", "k8s_standby_accelerators", mode="before")
    @classmethod
    def _csv(cls, value: object) -> object:
        return _split_csv(value)

    @field_validator("admin_key")
    @classmethod
    def _strong_admin_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        raw = value.get_secret_value()
        if raw.lower() in _WEAK_KEYS or len(raw) < 16:
            raise ValueError("EMBER_ADMIN_KEY must be at least 16 characters and not a default")
        return value

    @field_validator("prediction_log_url")
    @classmethod
    def _log_scheme(cls, value: str | None) -> str | None:
        if value is None or value == "off":
            return value
        parsed = urlparse(value)
        if parsed.scheme not in ("file", "s3") or (parsed.scheme == "s3" and not parsed.netloc):
            raise ValueError(
                "EMBER_PREDICTION_LOG_URL must be file:///dir, s3://bucket/prefix or off"
            )
        return value

    @field_validator("object_store_url")
    @classmethod
    def _store_scheme(cls, value: str | None) -> str | None:
        if value is not None and urlparse(value).scheme not in ("file", "s3"):
            raise ValueError("EMBER_OBJECT_STORE_URL must be a file:// or s3:// URL")
        if value is not None and value.startswith("s3://") and not urlparse(value).netloc:
            raise ValueError("EMBER_OBJECT_STORE_URL s3:// URL needs a bucket")
        return value

    @field_validator("jobs_api_url")
    @classmethod
    def _jobs_api_scheme(cls, value: str | None) -> str | None:
        if value is not None and urlparse(value).scheme not in ("http", "https"):
            raise ValueError("EMBER_JOBS_API_URL must be an http:// or https:// URL")
        return value

    @model_validator(mode="after")
    def _jobs_redelivery_after_timeout(self) -> Settings:
        # A message redelivered while its first attempt still runs would double the work.
        if self.jobs_visibility_timeout_s <= self.jobs_timeout_s:
            raise ValueError(
                "EMBER_JOBS_VISIBILITY_TIMEOUT_S must exceed EMBER_JOBS_TIMEOUT_S "
                f"({self.jobs_visibility_timeout_s:g} <= {self.jobs_timeout_s:g})"
            )
        return self

    @model_validator(mode="after")
    def _kubernetes_needs_an_image(self) -> Settings:
        if self.replica_backend == "kubernetes" and not self.k8s_image:
            raise ValueError("EMBER_REPLICA_BACKEND=kubernetes needs EMBER_K8S_IMAGE")
        if self.replica_backend == "kubernetes" and self.cache_dir is None:
            raise ValueError(
                "EMBER_REPLICA_BACKEND=kubernetes needs EMBER_CACHE_DIR: the nodes' NVMe "
                "cache path (terraform output ember_config)"
            )
        return self

    @model_validator(mode="after")
    def _absolute_paths(self) -> Settings:
        # Resolve once so that a later chdir (uvicorn reload, daemons) cannot move the data.
        object.__setattr__(self, "data_dir", self.data_dir.expanduser().resolve())
        roots = [p.expanduser().resolve() for p in self.file_roots]
        object.__setattr__(self, "file_roots", roots)
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", self.cache_dir.expanduser().resolve())
        return self

    # Derived locations: computed, never stored twice.
    @property
    def registry_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'registry.db'}"

    @property
    def store_url(self) -> str:
        return self.object_store_url or (self.data_dir / "objects").as_uri()

    @property
    def prediction_log_target(self) -> str:
        return self.prediction_log_url or (self.data_dir / "predictions").as_uri()

    @property
    def weight_cache_dir(self) -> Path:
        return self.cache_dir or self.data_dir / "cache"

    @property
    def allowed_file_roots(self) -> list[Path]:
        roots = list(self.file_roots)
        store = urlparse(self.store_url)
        if store.scheme == "file":
            roots.insert(0, Path(unquote(store.path)).resolve())  # as_uri() quotes
        return roots

    @property
    def allowed_buckets(self) -> set[str]:
        buckets = set(self.s3_allowed_buckets)
        store = urlparse(self.store_url)
        if store.scheme == "s3":
            buckets.add(store.netloc)
        return buckets


SWITCH_INTERVAL_S = 0.001
"""The GIL switch interval of Ember's busy multi-threaded processes, the API and the job
worker (Python's default is 5 ms): a thread that wants the GIL while another runs pure
Python waits up to this long. In the API the event loop waits so behind the prediction
log's digests and the controller's registry reads (in threads); measured with
``bench/serving.py`` at 10 req/s over five interleaved pairs, what the gateway adds around
the replica's own time at p99 was 2.8-4.2 ms (median 3.1) at 5 ms and 1.5-3.2 ms (median
2.9) at 1 ms, its p50 unchanged (1.1-1.2 ms): a small gain, within the noise of one pair. In
the worker a shard's model call waited behind the next shard being parsed."""

#: EMBER_* variables read by other parts of Ember (the CLI's client, a replica's secret), not by
#: ``Settings``.
CLIENT_VARIABLES = {"EMBER_URL", "EMBER_API_KEY", "EMBER_REPLICA_SECRET"}


def unknown_variables(environ: dict[str, str]) -> list[str]:
    """EMBER_* variables no setting reads — almost always a typo that would be ignored."""
    known = {f"EMBER_{name.upper()}" for name in Settings.model_fields} | CLIENT_VARIABLES
    return sorted(k for k in environ if k.startswith("EMBER_") and k not in known)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read from the environment once.

    Refuses unknown ``EMBER_*`` variables so that ``EMBER_PROT=9000`` is an error, not a
    server quietly listening on 8000.
    """
    unknown = unknown_variables(dict(os.environ))
    if unknown:
        known = [f"EMBER_{n.upper()}" for n in Settings.model_fields]
        hints = [
            f"{name} (did you mean {close[0]}?)" if (close := get_close_matches(name, known, 1))
            else name
            for name in unknown
        ]  # fmt: skip
        raise ValueError(f"unknown setting(s): {', '.join(hints)}")
    return Settings()


def settings_table() -> str:
    """The settings reference's table (docs/reference/settings.md), generated from the
    fields' docstrings."""
    rows = ["| Variable | Default | Meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
        shown = "unset" if default in (None, []) else f"`{default}`"
        text = " ".join((field.description or "").split()).replace("``", "`").replace("|", "\\|")
        rows.append(f"| `EMBER_{name.upper()}` | {shown} | {text} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(settings_table())
