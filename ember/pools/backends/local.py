"""Local process backend: replicas are ``ember engine`` processes on this machine.

Each replica gets a secret of its own (``ReplicaHandle.secret``, in its environment as
``REPLICA_SECRET_ENV``, never in argv or a log line), an environment built from
``ENV_ALLOWLIST`` (no admin key, database or broker URL), a private home, and — where the
API runs as root — an unprivileged uid of its tenant's (``EMBER_REPLICA_USER``): a cold
replica is started as it, a standby process drops to it on ``/assign``. The registry and
the other files of the data directory are left readable by the API's user only; each
tenant's weight cache is a directory of its own that only its uid can open.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ember
from ember.config import Settings
from ember.engine.privileges import blocked_for_others, raise_memlock, tenant_home
from ember.engine.spec import REPLICA_SECRET_ENV
from ember.loader.cache import tenant_cache_dir
from ember.logs import get_logger
from ember.pools.backends.base import LaunchOptions, ReplicaBackend, ReplicaHandle

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
    "LC_", "EMBER_S3_", "EMBER_CACHE_", "EMBER_LOADER_", "EMBER_LOG_", "VLLM_", "KMP_",
    "CUDA_MODULE_", "NCCL_", "TORCH_CUDA_",
)  # fmt: skip

AWS_PREFIX = "AWS_"
"""Cloud credentials: passed only where the replica's loader reads S3."""

DENIED = frozenset({
    "EMBER_ADMIN_KEY", "EMBER_DATABASE_URL", "EMBER_REDIS_URL", "EMBER_JOBS_API_KEY",
    "EMBER_API_KEY",
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


class LocalProcessBackend(ReplicaBackend):
    def __init__(self, settings: Settings, extra_env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.dir = settings.data_dir / "replicas"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.extra_env = extra_env or {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
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

    def _s3(self, spec: dict[str, Any] | None) -> bool:
        """Whether the replica may read S3 (and so gets the ``AWS_*`` credentials)."""
        if spec is not None:
            return str(spec.get("artifact_uri", "")).startswith("s3://")
        s = self.settings
        return s.store_url.startswith("s3://") or bool(s.s3_endpoint_url or s.s3_allowed_buckets)

    def launch(self, spec: dict[str, Any] | None, options: LaunchOptions) -> ReplicaHandle:
        replica_id = uuid.uuid4().hex[:10]
        port = _free_port()
        secret = secrets.token_urlsafe(32)
        exe = self.executable(spec)
        cmd = [str(exe), "engine", "--port", str(port), "--host", "127.0.0.1",
               "--replica-id", replica_id]  # fmt: skip
        for name, value in options.replica_settings().items():
            cmd += ["--" + name.replace("_", "-"), str(value)]
        user: tuple[int, int] | None = None
        if spec is None:
            home = _private_dir(self.dir / "home" / "standby", None)
            env = self._env(secret, self._s3(None), home)
            env["EMBER_CACHE_DIR"] = str(self.settings.weight_cache_dir)
            cmd.append("--standby")
            if options.reserve_bytes > 0:
                cmd += ["--reserve-bytes", str(options.reserve_bytes)]
        else:
            home, cache = self._tenant_dirs(options.tenant_id)
            user = self.user_of(options.tenant_id)
            self._grant(spec, user)
            env = self._env(secret, self._s3(spec), home)
            env["EMBER_CACHE_DIR"] = str(cache)
            spec_file = self.dir / f"{replica_id}.spec.json"
            fd = os.open(spec_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                if user is not None:
                    os.fchown(out.fileno(), *user)
                out.write(json.dumps(spec))
            cmd += ["--spec-file", str(spec_file)]
        log_path = self.dir / f"{replica_id}.log"
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as out:
            proc = subprocess.Popen(
                cmd, env=env, cwd=home, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, **_as_user(user),
            )  # fmt: skip
        self.procs[replica_id] = proc
        log.info("replica launched", replica_id=replica_id, pid=proc.pid, port=port,
                 standby=spec is None, uid=user[0] if user else os.geteuid())  # fmt: skip
        return ReplicaHandle(replica_id, f"http://127.0.0.1:{port}", proc.pid, port,
                             {"log": str(log_path)}, secret=secret)  # fmt: skip

    def assign_query(
        self, handle: ReplicaHandle, spec: dict[str, Any], options: LaunchOptions
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

    def _grant(self, spec: dict[str, Any], user: tuple[int, int] | None) -> None:
        """A version in the local object store becomes its tenant's uid's to read: the
        files of its artifact's directory (the weights and their sidecars) are given to
        that uid. Artifacts elsewhere (``EMBER_FILE_ROOTS``) must be readable by others."""
        store = self.settings.store_url
        uri = str(spec.get("artifact_uri", ""))
        if user is None or not store.startswith("file://") or not uri.startswith("file://"):
            return
        root = Path(store.removeprefix("file://")).resolve()
        folder = Path(uri.removeprefix("file://")).resolve().parent
        if not folder.is_relative_to(root) or not folder.is_dir():
            return
        for entry in folder.iterdir():
            if entry.is_file() and not entry.is_symlink():
                os.chown(entry, *user)

    def executable(self, spec: dict[str, Any] | None) -> Path:
        """The ``ember`` that runs ``spec``: vLLM versions run in vLLM's own environment
        (``EMBER_VLLM_EXECUTABLE``, else ``.venv-vllm/bin/ember`` beside this virtualenv
        when it exists), everything else — and standby processes — in this one."""
        own = Path(sys.executable).with_name("ember")
        if spec is None or spec.get("engine") != "vllm":
            return own
        if self.settings.vllm_executable is not None:
            return self.settings.vllm_executable
        beside = Path(sys.prefix).parent / ".venv-vllm" / "bin" / "ember"
        return beside if beside.exists() else own

    def standby_can_run(self, spec: dict[str, Any]) -> bool:
        return self.executable(spec) == self.executable(None)

    def exited(self, handle: ReplicaHandle) -> int | None:
        proc = self.procs.get(handle.replica_id)
        return proc.poll() if proc is not None else -1

    def stop(self, handle: ReplicaHandle, grace_s: float = 10.0) -> None:
        proc = self.procs.pop(handle.replica_id, None)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def kill(self, handle: ReplicaHandle) -> None:
        proc = self.procs.pop(handle.replica_id, None)
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGKILL)  # works on a SIGSTOPped process too
        proc.wait(5)

    def close(self) -> None:
        for replica_id in list(self.procs):
            self.stop(ReplicaHandle(replica_id, ""), grace_s=5)
