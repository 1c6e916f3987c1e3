"""Local process backend: replicas are ``ember engine`` processes on this machine."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from ember.config import Settings
from ember.logs import get_logger
from ember.pools.backends.base import LaunchOptions, ReplicaBackend, ReplicaHandle

log = get_logger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalProcessBackend(ReplicaBackend):
    def __init__(self, settings: Settings, extra_env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.dir = settings.data_dir / "replicas"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.extra_env = extra_env or {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["EMBER_DATA_DIR"] = str(self.settings.data_dir)
        env.setdefault("EMBER_LOG_FORMAT", "json")
        return env | self.extra_env

    def launch(self, spec: dict[str, Any] | None, options: LaunchOptions) -> ReplicaHandle:
        replica_id = uuid.uuid4().hex[:10]
        port = _free_port()
        exe = self.executable(spec)
        cmd = [str(exe), "engine", "--port", str(port), "--replica-id", replica_id]
        for name, value in options.replica_settings().items():
            cmd += ["--" + name.replace("_", "-"), str(value)]
        if spec is None:
            cmd.append("--standby")
            if options.reserve_bytes > 0:
                cmd += ["--reserve-bytes", str(options.reserve_bytes)]
        else:
            spec_file = self.dir / f"{replica_id}.spec.json"
            spec_file.write_text(json.dumps(spec))
            cmd += ["--spec-file", str(spec_file)]
        log_path = self.dir / f"{replica_id}.log"
        with log_path.open("ab") as out:
            proc = subprocess.Popen(cmd, env=self._env(), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self.procs[replica_id] = proc
        return ReplicaHandle(replica_id, f"http://127.0.0.1:{port}", proc.pid, port,
                             {"log": str(log_path)})  # fmt: skip

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
