"""vLLM on the GPU: the tiny Llama as a sharded directory version, served by an ``ember
engine --device cuda`` replica from a vLLM GPU build (``.venv-vllm`` beside this venv, as
the local backend finds it, or this interpreter when it has vLLM), its weights through
Ember's loader. Warm is vLLM's sleep mode level 1 (weights to host memory, KV cache
dropped: the device memory is given back) and hot is ``wake_up``; the same greedy
completion before and after. Start, sleep and wake are timed (``record_property``).

Skipped off CUDA (vLLM on the CPU is tests/engine_vllm) and where no vLLM GPU build is
importable (vLLM's CUDA wheels need a network to install)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.config import Settings
from ember.registry import validation
from tests.gpu.cuda import DEVICE, ON_CUDA, cuda_only, needs_device
from tests.services import free_port

pytestmark = [needs_device, cuda_only, pytest.mark.timeout(600)]
Record = Callable[[str, object], None]
ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llm-gpu"
START_TIMEOUT_S = 300
PROBE = "import torch, vllm, ember.engine.vllm_plugin; print(vllm.__version__, torch.cuda.is_available())"  # noqa: E501


def vllm_ember() -> tuple[Path, str]:
    """The ``ember`` of an environment whose vLLM runs on CUDA, and vLLM's version."""
    tried = []
    for python in (ROOT / ".venv-vllm" / "bin" / "python", Path(sys.executable)):
        if not python.exists():
            continue
        run = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True,
                             timeout=180, cwd=ROOT)  # fmt: skip
        out = run.stdout.split()
        if run.returncode == 0 and out[-1:] == ["True"] and python.with_name("ember").exists():
            return python.with_name("ember"), out[0]
        tried.append(f"{python}: " + (run.stderr.strip().splitlines() or out or ["?"])[-1])
    pytest.skip("no vLLM GPU build importable (" + "; ".join(tried or ["no .venv-vllm"]) + ")")


def used_mib() -> int | None:
    """Memory in use on the GPU, as the driver counts it (vLLM's own allocator included)."""
    smi = shutil.which("nvidia-smi")
    if smi is None or not ON_CUDA:
        return None
    index = str(DEVICE.index or 0)
    out = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                          "-i", index], capture_output=True, text=True, timeout=30)  # fmt: skip
    return int(out.stdout.strip()) if out.returncode == 0 else None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):  # vLLM's engine core may outlive it
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, float]]:
    from ember.engine.examples.tiny_llm import build_tiny_llm

    ember, _ = vllm_ember()
    root = tmp_path_factory.mktemp("vllm-gpu")
    data_dir = root / "ember-data"
    folder = build_tiny_llm(data_dir / "objects" / MODEL / "1", sharded=True)
    uri = folder.as_uri() + "/"
    facts = validation.inspect_artifact(uri, Settings(data_dir=data_dir), None)
    spec = {"model": MODEL, "version": "1", "artifact_uri": uri, "sha256": facts.sha256,
            "files": facts.files, "engine": "vllm",
            "engine_config": {"max_model_len": 256, "max_tokens": 8, "enforce_eager": True,
                              "kv_cache_bytes": 256 * 1024**2}}  # fmt: skip
    spec_file = root / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "TEST_"))}
    env |= {"EMBER_DATA_DIR": str(data_dir), "EMBER_LOG_FORMAT": "json",
            "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    log = root / "replica.log"
    cmd = [str(ember), "engine", "--spec-file", str(spec_file), "--port", str(port),
           "--host", "127.0.0.1", "--replica-id", "gpu-check", "--device", str(DEVICE)]  # fmt: skip
    started = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"replica exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                info = httpx.get(f"{url}/info", timeout=2).json()
                if info["state"] == "ready":
                    break
                if info["state"] == "failed":
                    pytest.fail(f"replica failed: {info['failure']}\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"not ready in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url, log, time.perf_counter() - started
    finally:
        _stop(proc)


def complete(url: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "The replica serves", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def set_tier(url: str, tier: str) -> float:
    t0 = time.perf_counter()
    response = httpx.post(f"{url}/tier", json={"tier": tier}, timeout=300)
    assert response.status_code == 200, response.text
    seconds = time.perf_counter() - t0
    assert httpx.get(f"{url}/healthz", timeout=10).json()["tier"] == tier
    return seconds


def test_vllm_sleeps_and_wakes_on_the_gpu(
    replica: tuple[str, Path, float], record_property: Record
) -> None:
    url, log, start_s = replica
    record_property("vllm_start_to_ready_s", round(start_s, 2))
    first = complete(url)
    assert first["usage"]["completion_tokens"] == 8
    hot_mib = used_mib()
    record_property("vllm_sleep_s", round(set_tier(url, "warm"), 3))
    warm_mib = used_mib()
    response = httpx.post(f"{url}/infer", json={"instances": ["a"]}, timeout=30)
    assert response.status_code >= 400  # warm: not serving until promoted
    record_property("vllm_wake_s", round(set_tier(url, "hot"), 3))
    again = complete(url)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]  # greedy: same tokens
    if hot_mib is not None and warm_mib is not None:
        record_property("vllm_device_mib_hot", hot_mib)
        record_property("vllm_device_mib_warm", warm_mib)
        assert warm_mib < hot_mib, f"sleep gave no device memory back ({hot_mib} MiB)"
    loads = [json.loads(x) for x in log.read_text().splitlines() if '"weights loaded"' in x]
    assert loads and all(x.get("model") == MODEL for x in loads)  # through Ember's loader
