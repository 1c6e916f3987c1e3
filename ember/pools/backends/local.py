"""Local process backend: replicas are ``ember engine`` processes on this machine.

Each replica gets a secret of its own (``ReplicaHandle.secret``, in its environment as
``REPLICA_SECRET_ENV``, never in argv or a log line), an environment built from
``ENV_ALLOWLIST`` (no admin key, database or broker URL), a private home, and — where the
API runs as root — an unprivileged uid of its tenant's (``EMBER_REPLICA_USER``): a cold
replica is started as it, a standby process drops to it on ``/assign``. The registry and
the other files of the data directory are left readable by the API's user only; each
tenant's weight cache is a directory of its own that only its uid can open.

GPUs (``EMBER_GPUS``, ``ember.pools.backends.gpus``): a replica whose deployment's
placement names an ``accelerator`` with ``gpus`` > 0 gets that many whole devices of this
host — any of them: the accelerator's type is matched by a cluster's node labels, not
here — as its ``CUDA_VISIBLE_DEVICES`` (UUIDs where NVML found the devices), and runs
``--device cuda``. Every other replica and every standby process gets
``CUDA_VISIBLE_DEVICES=""`` — none of the API's own — and runs on the CPU. A device is
held from its replica's start until the process is seen gone (stopped, killed or dead), so
no device is ever given twice. A replica that does not fit is not started: it waits in
arrival order, none overtaking another (``waiting`` says why; the controller lists it as
``queued``), and starts once its devices are free. One that asks for more GPUs than the
host has at all — on a host without GPUs, any — is refused at once: ``exited`` reports it
gone, ``exit_reason`` why. Consequences: a version that needs GPUs never takes a standby
process (standby processes are generic and hold no device: one held idle for a version
that may never come costs a whole GPU), so its replicas always start cold; a warm GPU
replica keeps its devices (its weights are in pinned host memory, its device memory is
released, the devices stay its own); and a new version of a deployment whose replicas hold
every device waits, since the controller retires the old version only once the new one is
ready — such a rollout needs free devices.
"""

from __future__ import annotations

import os
import pwd
import secrets
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import ember
from ember.config import Settings
from ember.domain.gpus import Gpu
from ember.domain.spec import REPLICA_SECRET_ENV, VersionSpec
from ember.engine.privileges import blocked_for_others, raise_memlock, tenant_home
from ember.loader.cache import tenant_cache_dir
from ember.logs import bound, get_logger, model_context
from ember.pools.backends.base import LaunchOptions, ReplicaBackend, ReplicaHandle
from ember.pools.backends.gpus import CUDA_VISIBLE, GpuPool, discover

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from ember.registry.schemas import Placement

log = get_logger(__name__)

ENV_ALLOWLIST = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
    "PYTHONWARNINGS", "PYTHONFAULTHANDLER", "PYTHONMALLOC",
    "EMBER_OBJECT_STORE_URL", "EMBER_FILE_ROOTS", "EMBER_MAX_REQUEST_BYTES",
    "EMBER_ARTIFACT_MAX_HEADER_BYTES", "EMBER_ENGINE_FACTORIES", "EMBER_VLLM_ARGS_ALLOWED",
    "EMBER_VLLM_EXECUTABLE",
})  # fmt: skip
"""The environment variables a replica process inherits (exact names), besides those
starting with ``ENV_PREFIXES`` and ``EMBER_REPLICA_ENV_PASSTHROUGH``'s. What a replica
reads: the object store and loader settings, logging, threads, the device; never the
admin key, the database or broker URL, the jobs key or any other platform secret."""

ENV_PREFIXES = (
    "LC_", "EMBER_S3_", "EMBER_CACHE_", "EMBER_LOADER_", "EMBER_LOG_", "EMBER_OTEL_", "VLLM_",
    "KMP_", "CUDA_MODULE_", "NCCL_", "TORCH_CUDA_",
)  # fmt: skip

AWS_PREFIX = "AWS_"
"""Cloud credentials: passed only where the replica's loader reads S3."""

DENIED = frozenset({
    "EMBER_ADMIN_KEY", "EMBER_DATABASE_URL", "EMBER_REDIS_URL", "EMBER_JOBS_API_KEY",
    "EMBER_API_KEY", "EMBER_OTEL_HEADERS",
})  # fmt: skip
"""Never passed on, whatever ``EMBER_REPLICA_ENV_PASSTHROUGH`` says."""


def replica_environ(
    environ: dict[str, str], *, s3: bool, passthrough: list[str] | tuple[str, ...] = ()
) -> dict[str, str]:
    """The part of ``environ`` a replica inherits (``ENV_ALLOWLIST``, ``ENV_PREFIXES``,
    ``passthrough``; ``AWS_*`` only when ``s3``), never a ``DENIED`` name."""
    extra = set(passthrough)
    return {
        k: v
        for k, v in environ.items()
        if k not in DENIED
        and (
            k in ENV_ALLOWLIST
            or k.startswith(ENV_PREFIXES)
            or k in extra
            or (s3 and k.startswith(AWS_PREFIX))
        )
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _private_dir(path: Path, owner: tuple[int, int] | None) -> Path:
    """``path`` as a 0700 directory of ``owner`` (uid, gid; None: this process's user)."""
    path.mkdir(parents=True, exist_ok=True)
    if owner is not None and os.geteuid() == 0:
        os.chown(path, *owner)
    path.chmod(0o700)
    return path


def _as_user(user: tuple[int, int] | None) -> dict[str, Any]:
    """``Popen`` arguments that start the child as ``uid:gid`` with no supplementary
    groups: the drop happens in the forked child without running Python there (a
    ``preexec_fn`` may deadlock in a threaded parent, which the API is)."""
    if user is None:
        return {}
    return {"user": user[0], "group": user[1], "extra_groups": []}


def gpus_asked(placement: Placement | None) -> int:
    """The devices a replica of ``placement`` needs here: ``gpus`` where it names an
    ``accelerator`` (as the Kubernetes backend asks for ``nvidia.com/gpu``), else none."""
    return placement.gpus if placement is not None and placement.accelerator else 0


def _context(spec: VersionSpec | None) -> AbstractContextManager[None]:
    """The log context of a replica of ``spec`` (a standby process: none)."""
    if spec is None:
        return bound()
    return model_context(spec.model, spec.version)


@dataclass
class _Launch:
    """A replica made ready to start: everything but its port and devices."""

    handle: ReplicaHandle
    exe: Path
    args: list[str]
    """``ember engine``'s arguments after ``--port``."""
    env: dict[str, str]
    home: Path
    user: tuple[int, int] | None
    spec: VersionSpec | None


class LocalProcessBackend(ReplicaBackend):
    def __init__(self, settings: Settings, extra_env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.dir = settings.data_dir / "replicas"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.extra_env = extra_env or {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()
        """Guards the processes, the devices and the queue: the controller calls in from
        its loop and from threads (``stop``)."""
        self.gpus = GpuPool(discover(settings.gpus, os.environ))
        self.queued: dict[str, _Launch] = {}
        """Replicas waiting for devices, not started (``gpus.queue`` holds their order)."""
        self.refused: dict[str, str] = {}
        """Replicas that will never start here, with the reason."""
        self._dying: dict[str, subprocess.Popen[bytes]] = {}
        """Processes signalled to end: their devices are free once they are seen gone."""
        inventory = self.gpus.inventory
        log.info("gpus for local replicas", gpus=[g.public() for g in inventory.gpus],
                 source=inventory.source, note=inventory.note or None)  # fmt: skip
        self._lock_down()
        self.users = self._replica_users()
        if self.users is not None:
            raise_memlock()  # while root: the replicas inherit it (the loader mlocks weights)
        """Tenant id → (uid, gid) its replicas run as; None: the API's own user."""

    # --- who a replica runs as --------------------------------------------------------

    def _replica_users(self) -> Callable[[int], tuple[int, int]] | None:
        choice = self.settings.replica_user.strip()
        if choice == "off":
            return None
        if choice == "auto":
            if os.geteuid() != 0:
                return None
            in_the_way = self._blocked()
            if in_the_way is not None:
                log.warning(
                    "replicas run as root: a directory they need is not traversable by "
                    "other users (make it o+x, or set EMBER_REPLICA_USER=off to say so)",
                    directory=str(in_the_way),
                )
                return None
            base = self.settings.replica_uid_base
            return lambda tenant_id: (base + tenant_id, base + tenant_id)
        try:
            entry = pwd.getpwuid(int(choice)) if choice.isdigit() else pwd.getpwnam(choice)
            uid, gid = entry.pw_uid, entry.pw_gid
        except KeyError:
            if not choice.isdigit():
                raise ValueError(f"EMBER_REPLICA_USER: no user {choice!r}") from None
            uid = gid = int(choice)
        if uid == os.geteuid():
            return None
        if os.geteuid() != 0:
            raise ValueError("EMBER_REPLICA_USER names another user: the API must run as root")
        in_the_way = self._blocked()
        if in_the_way is not None:
            raise ValueError(
                f"EMBER_REPLICA_USER={choice}: {in_the_way} is not traversable by other "
                "users, and the replicas need what is below it"
            )
        return lambda tenant_id: (uid, gid)

    def _blocked(self) -> Path | None:
        """The first directory a replica's uid could not traverse to reach what it needs:
        the interpreter and its standard library, the virtualenv, Ember's code, the data
        directory, the weight cache and a local object store."""
        needs = [
            Path(sys.executable).resolve(),
            Path(sys.base_prefix).resolve(),
            Path(sys.prefix),
            Path(ember.__file__).resolve().parent,
            self.settings.data_dir,
            self.settings.weight_cache_dir,
        ]
        if self.settings.vllm_executable is not None:
            needs.append(self.settings.vllm_executable.resolve())
        if self.settings.store_url.startswith("file://"):
            needs.append(Path(self.settings.store_url.removeprefix("file://")))
        needs += self.settings.allowed_file_roots
        for path in needs:
            found = blocked_for_others(path)
            if found is not None:
                return found
        return None

    def _lock_down(self) -> None:
        """The data directory as replicas may see it: they traverse it to their own files
        (``replicas/``, ``cache/``, ``objects/``); the registry and everything else in it
        is the API's user's only (the registry file is made 0600 by this too, when it
        exists already; SQLite gives its journal the database file's mode)."""
        data, cache = self.settings.data_dir, self.settings.weight_cache_dir
        for entry in data.iterdir():
            if entry.name in ("replicas", "cache", "objects") or entry.is_symlink():
                continue
            entry.chmod(0o700 if entry.is_dir() else 0o600)
        for path in (self.dir, cache):
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o711)  # traversable, not listable

    def user_of(self, tenant_id: int) -> tuple[int, int] | None:
        """The (uid, gid) tenant ``tenant_id``'s replicas run as (None: the API's user)."""
        return self.users(tenant_id) if self.users is not None and tenant_id > 0 else None

    def _tenant_dirs(self, tenant_id: int) -> tuple[Path, Path]:
        """The tenant's private home and weight cache, made (0700, its uid's) if missing."""
        owner = self.user_of(tenant_id)
        home = _private_dir(tenant_home(self.settings.data_dir, tenant_id), owner)
        cache = tenant_cache_dir(self.settings.weight_cache_dir, tenant_id)
        return home, _private_dir(cache, owner)

    # --- the process ------------------------------------------------------------------

    def _env(self, secret: str, s3: bool, home: Path) -> dict[str, str]:
        settings = self.settings
        env = replica_environ(dict(os.environ), s3=s3, passthrough=settings.replica_env_passthrough)
        env["EMBER_DATA_DIR"] = str(settings.data_dir)
        env.setdefault("EMBER_LOG_FORMAT", "json")
        env["HOME"] = str(home)
        env = env | self.extra_env
        env[REPLICA_SECRET_ENV] = secret
        return env

    def _s3(self, spec: VersionSpec | None) -> bool:
        """Whether the replica may read S3 (and so gets the ``AWS_*`` credentials)."""
        if spec is not None:
            return spec.artifact_uri.startswith("s3://")
        s = self.settings
        return s.store_url.startswith("s3://") or bool(s.s3_endpoint_url or s.s3_allowed_buckets)

    def launch(self, spec: VersionSpec | None, options: LaunchOptions) -> ReplicaHandle:
        """Start the replica now, or — one that needs GPUs not free yet — queue it (it
        starts when they are); one that asks for more GPUs than the host has is refused
        (``exited`` says so at once, ``exit_reason`` why)."""
        handle = ReplicaHandle(uuid.uuid4().hex[:10], "", secret=secrets.token_urlsafe(32))
        handle.extra["log"] = str(self.dir / f"{handle.replica_id}.log")
        asked = gpus_asked(options.placement) if spec is not None else 0
        refusal = self.gpus.refusal(asked)
        if refusal is not None:
            with self._lock:
                self.refused[handle.replica_id] = refusal
            with _context(spec):
                log.warning("replica refused", replica_id=handle.replica_id, reason=refusal)
            return handle
        prepared = self._prepare(handle, spec, options)
        with self._lock:
            if not asked:
                self._spawn(prepared, ())
                return handle
            self.gpus.ask(handle.replica_id, asked)
            self.queued[handle.replica_id] = prepared
            self._admit()
            reason = self._waiting(handle.replica_id)
        if reason is not None:
            with _context(spec):
                log.info("replica queued", replica_id=handle.replica_id, reason=reason)
        return handle

    def _prepare(
        self, handle: ReplicaHandle, spec: VersionSpec | None, options: LaunchOptions
    ) -> _Launch:
        """Everything a replica's process needs but its port and devices: its arguments,
        environment, home and user, and its spec file."""
        args = ["--host", "127.0.0.1", "--replica-id", handle.replica_id]
        for name, value in options.replica_settings().items():
            args += ["--" + name.replace("_", "-"), str(value)]
        user: tuple[int, int] | None = None
        if spec is None:
            home = _private_dir(self.dir / "home" / "standby", None)
            env = self._env(handle.secret, self._s3(None), home)
            env["EMBER_CACHE_DIR"] = str(self.settings.weight_cache_dir)
            args.append("--standby")
            if options.reserve_bytes > 0:
                args += ["--reserve-bytes", str(options.reserve_bytes)]
        else:
            home, cache = self._tenant_dirs(options.tenant_id)
            user = self.user_of(options.tenant_id)
            self._grant(spec, user)
            env = self._env(handle.secret, self._s3(spec), home)
            env["EMBER_CACHE_DIR"] = str(cache)
            spec_file = self.dir / f"{handle.replica_id}.spec.json"
            fd = os.open(spec_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                if user is not None:
                    os.fchown(out.fileno(), *user)
                out.write(spec.model_dump_json())
            args += ["--spec-file", str(spec_file)]
        return _Launch(handle, self.executable(spec), args, env, home, user, spec)

    def _spawn(self, prepared: _Launch, devices: tuple[Gpu, ...]) -> None:
        """Start the process on ``devices`` (none: the CPU, no device visible at all, the
        API's own ``CUDA_VISIBLE_DEVICES`` notwithstanding). Called under the lock."""
        handle, port = prepared.handle, _free_port()
        cmd = [str(prepared.exe), "engine", "--port", str(port), *prepared.args,
               "--parent-pid", str(os.getpid())]  # fmt: skip
        if devices:
            cmd += ["--device", "cuda"]
        env = prepared.env | {CUDA_VISIBLE: ",".join(g.id for g in devices)}
        fd = os.open(handle.extra["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as out:
            proc = subprocess.Popen(
                cmd, env=env, cwd=prepared.home, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, **_as_user(prepared.user),
            )  # fmt: skip
        self.procs[handle.replica_id] = proc
        handle.url, handle.pid, handle.port = f"http://127.0.0.1:{port}", proc.pid, port
        handle.extra["gpus"] = [g.id for g in devices]
        user = prepared.user
        with _context(prepared.spec):
            log.info("replica launched", replica_id=handle.replica_id, pid=proc.pid, port=port,
                     standby=prepared.spec is None, uid=user[0] if user else os.geteuid(),
                     gpus=handle.extra["gpus"])  # fmt: skip

    def _admit(self) -> None:
        """Free the devices of processes seen gone, then start the queued replicas that
        fit now, first come first served. Called under the lock."""
        for replica_id, proc in list(self._dying.items()):
            if proc.poll() is not None:
                del self._dying[replica_id]
                self.gpus.release(replica_id)
        for replica_id, devices in self.gpus.admit():
            prepared = self.queued.pop(replica_id)
            try:
                self._spawn(prepared, devices)
            except OSError as exc:  # its reason is shown to the tenant: no path in it
                self.gpus.release(replica_id)
                self.refused[replica_id] = f"the replica process did not start: {exc.strerror}"

    def waiting(self, handle: ReplicaHandle) -> str | None:
        with self._lock:
            return self._waiting(handle.replica_id)

    def _waiting(self, replica_id: str) -> str | None:
        return self.gpus.waiting(replica_id) if replica_id in self.queued else None

    def standby_can_take(
        self, handle: ReplicaHandle, spec: VersionSpec, options: LaunchOptions
    ) -> bool:
        """Never for a version that needs GPUs: standby processes hold no device."""
        return gpus_asked(options.placement) == 0 and self.standby_can_run(spec)

    def assign_query(
        self, handle: ReplicaHandle, spec: VersionSpec, options: LaunchOptions
    ) -> dict[str, Any]:
        """The tenant (its cache directory and home) and the uid a standby process drops
        to before it reads the version (made here, as the API's user)."""
        self._tenant_dirs(options.tenant_id)
        query: dict[str, Any] = {"tenant_id": options.tenant_id}
        user = self.user_of(options.tenant_id)
        if user is not None:
            self._grant(spec, user)
            query["uid"], query["gid"] = user
        return query

    def _grant(self, spec: VersionSpec, user: tuple[int, int] | None) -> None:
        """A version in the local object store becomes its tenant's uid's to read: the
        files of its artifact's directory (the weights and their sidecars) are given to
        that uid. Artifacts elsewhere (``EMBER_FILE_ROOTS``) must be readable by others."""
        store = self.settings.store_url
        uri = spec.artifact_uri
        if user is None or not store.startswith("file://") or not uri.startswith("file://"):
            return
        root = Path(store.removeprefix("file://")).resolve()
        path = Path(unquote(uri.removeprefix("file://"))).resolve()
        directory = uri.endswith("/")  # a directory version: all of its files, any depth
        folder = path if directory else path.parent
        if not folder.is_relative_to(root) or not folder.is_dir():
            return
        for entry in folder.rglob("*") if directory else folder.iterdir():
            if entry.is_file() and not entry.is_symlink():
                os.chown(entry, *user)

    def executable(self, spec: VersionSpec | None) -> Path:
        """The ``ember`` that runs ``spec``: vLLM versions run in vLLM's own environment
        (``EMBER_VLLM_EXECUTABLE``, else ``.venv-vllm/bin/ember`` beside this virtualenv
        when it exists), everything else — and standby processes — in this one."""
        own = Path(sys.executable).with_name("ember")
        if spec is None or spec.engine != "vllm":
            return own
        if self.settings.vllm_executable is not None:
            return self.settings.vllm_executable
        beside = Path(sys.prefix).parent / ".venv-vllm" / "bin" / "ember"
        return beside if beside.exists() else own

    def standby_can_run(self, spec: VersionSpec) -> bool:
        return self.executable(spec) == self.executable(None)

    def exited(self, handle: ReplicaHandle) -> int | None:
        """The exit status once the process is gone (its devices are free from then on);
        None while it runs or waits in the queue; 1 for a replica refused."""
        replica_id = handle.replica_id
        with self._lock:
            self._admit()
            if replica_id in self.queued:
                return None
            if replica_id in self.refused:
                return 1
            proc = self.procs.get(replica_id)
            if proc is None:
                return -1
            status = proc.poll()
            if status is not None and replica_id in self.gpus.held:
                self.gpus.release(replica_id)
                self._admit()
            return status

    def exit_reason(self, handle: ReplicaHandle) -> str | None:
        with self._lock:
            return self.refused.get(handle.replica_id)

    def _take(self, replica_id: str) -> subprocess.Popen[bytes] | None:
        """Forget the replica, a queued or refused one wholly; its process, if it has one,
        to be ended (its devices are free once it is seen gone: ``_gone``)."""
        with self._lock:
            self.refused.pop(replica_id, None)
            if self.queued.pop(replica_id, None) is not None:
                self.gpus.release(replica_id)
                self._admit()
            return self.procs.pop(replica_id, None)

    def _gone(self, replica_id: str, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._dying[replica_id] = proc
            self._admit()

    def stop(self, handle: ReplicaHandle, grace_s: float = 10.0) -> None:
        proc = self._take(handle.replica_id)
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        finally:
            self._gone(handle.replica_id, proc)

    def kill(self, handle: ReplicaHandle) -> None:
        proc = self._take(handle.replica_id)
        if proc is None:
            return
        try:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)  # works on a SIGSTOPped process too
                proc.wait(5)
        finally:
            self._gone(handle.replica_id, proc)

    def close(self) -> None:
        with self._lock:
            for replica_id in list(self.queued):
                self.gpus.release(replica_id)
            self.queued.clear()
        for replica_id in list(self.procs):
            self.stop(ReplicaHandle(replica_id, ""), grace_s=5)
