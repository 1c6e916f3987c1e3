"""The OpenAI-compatible API on a whole platform: the tiny LLM registered and deployed
like any model, its vLLM replica started by the pools controller, and the official
``openai`` client calling ``/openai/v1`` on the gateway — plain, streamed, with usage.

The API process runs from the main virtualenv (no vLLM there, as after ``make up``); the
local backend starts the vLLM version's replica with ``.venv-vllm/bin/ember`` beside it.
"""

from __future__ import annotations

import contextlib
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

from tests.services import background_job, free_port

openai = pytest.importorskip("openai", reason="pip install openai (the client side of these tests)")

ROOT = Path(__file__).resolve().parents[2]
VLLM_EMBER = ROOT / ".venv-vllm" / "bin" / "ember"
MAIN_EMBER = Path(sys.executable).with_name("ember")
START_TIMEOUT_S = float(os.environ.get("EMBER_TEST_VLLM_START_S", "300"))
ADMIN_KEY = "ek_test-openai-gateway-0123456789"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
MODEL = "tiny-llm"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@dataclass(frozen=True)
class Platform:
    url: str
    admin: httpx.Client
    log: Path
    data_dir: Path

    def client(self, key: str = ADMIN_KEY) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/openai/v1", api_key=key, max_retries=0,
                             timeout=120)  # fmt: skip

    def replicas(self) -> list[dict[str, Any]]:
        got = self.admin.get(f"/v1/deployments/{MODEL}/replicas").json()
        return list(got["replicas"])


def _wait(check: Any, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the API exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            if check():
                return
        time.sleep(1)
    pytest.fail(f"{what}: not within {START_TIMEOUT_S:.0f} s\n{log.read_text()[-6000:]}")


def _replica_logs(data_dir: Path) -> str:
    logs = sorted((data_dir / "replicas").glob("*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    from ember.engine.examples.tiny_llm import build_tiny_llm

    built = background_job("vllm-venv")  # `make test` builds it while the other suites run
    if built is not None and built[0] != 0:
        pytest.fail(f"scripts/vllm-venv.sh exited {built[0]}:\n{built[1][-6000:]}")
    if not VLLM_EMBER.exists():
        pytest.skip(".venv-vllm is absent: build it with scripts/vllm-venv.sh (make test does)")
    root = tmp_path_factory.mktemp("openai-gateway")
    data_dir = root / "ember-data"
    artifact = build_tiny_llm(data_dir / "objects" / MODEL / "1")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env |= {"EMBER_DATA_DIR": str(data_dir), "EMBER_ADMIN_KEY": ADMIN_KEY,
            "EMBER_HOST": "127.0.0.1", "EMBER_PORT": str(port), "EMBER_STANDBY_REPLICAS": "0",
            "EMBER_LOG_FORMAT": "json", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    log = root / "api.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(MAIN_EMBER), "serve"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    admin = httpx.Client(base_url=url, headers=AUTH, timeout=60)
    pids: set[int] = set()
    try:
        _wait(lambda: httpx.get(f"{url}/readyz").status_code == 200, "the API", proc, log)
        admin.post("/v1/models", json={"name": MODEL})
        body = {"version": "1", "artifact_uri": (artifact / "model.safetensors").as_uri(),
                "engine": "vllm", "engine_config": {"max_model_len": 256, "max_tokens": 8,
                                                    "kv_cache_bytes": 64 * 1024**2}}  # fmt: skip
        created = admin.post(f"/v1/models/{MODEL}/versions", json=body)
        assert created.status_code == 201, created.text
        deployed = admin.post("/v1/deployments", json={"model": MODEL, "version": "1"})
        assert deployed.status_code == 201, deployed.text
        platform = Platform(url, admin, log, data_dir)

        def ready() -> bool:
            replicas = platform.replicas()
            pids.update(r["pid"] for r in replicas if r["pid"])
            if any(r["state"] == "failed" for r in replicas):
                pytest.fail(f"the replica failed:\n{_replica_logs(data_dir)}")
            return any(r["state"] == "ready" for r in replicas)

        _wait(ready, "the vLLM replica", proc, log)
        yield platform
    finally:
        admin.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the API stops its replicas on the way out
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for pid in pids:  # a replica's vLLM engine core lives in the replica's group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        print(f"api log: {log}", file=sys.stderr)


def _inflight(platform: Platform) -> float:
    return sum(r["inflight_units"] for r in platform.replicas())


def test_models_lists_the_deployment(platform: Platform) -> None:
    ids = [m.id for m in platform.client().models.list().data]
    assert ids == [MODEL, f"{MODEL}:1"]


def test_completion_through_the_gateway_reports_usage(platform: Platform) -> None:
    client = platform.client()
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="The gateway routes", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert raw.headers["x-ember-version"] == "1" and raw.headers["x-ember-deployment"] == MODEL
    assert raw.headers["x-ember-replica"] == platform.replicas()[0]["replica_id"]
    out = raw.parse()
    assert out.choices[0].text and out.model == MODEL  # vLLM's body, untouched
    assert out.usage is not None and out.usage.prompt_tokens > 0
    assert out.usage.completion_tokens == 6
    pinned = client.completions.create(model=f"{MODEL}:1", prompt="a", max_tokens=2)
    assert pinned.usage is not None and 1 <= pinned.usage.completion_tokens <= 2


def test_chat_plain_and_streamed_agree(platform: Platform) -> None:
    client = platform.client()
    messages = [{"role": "user", "content": "Every request streams through the gateway."}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 7, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    plain = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert len(chunks) > 3  # tokens arrive as events, not as one body
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content  # greedy: the same tokens
    usage = chunks[-1].usage
    assert usage is not None and plain.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, 7)
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="a b", max_tokens=5, stream=True,
                                           temperature=0, extra_body={"ignore_eos": True})
        if c.choices
    )  # fmt: skip
    assert text
    assert _inflight(platform) == 0


def test_a_stream_the_client_leaves_releases_the_replica(platform: Platform) -> None:
    body = {"model": MODEL, "prompt": "a", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{platform.url}/openai/v1/completions", json=body, headers=AUTH,
                      timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    deadline = time.monotonic() + 30
    while _inflight(platform) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _inflight(platform) == 0
    # The replica still serves (its generation was aborted, not left hanging).
    out = platform.client().completions.create(model=MODEL, prompt="a", max_tokens=2)
    assert out.usage is not None


def test_errors_are_openai_errors(platform: Platform) -> None:
    client = platform.client()
    with pytest.raises(openai.BadRequestError):  # vLLM's own 400, passed through
        client.completions.create(model=MODEL, prompt="a", max_tokens=10_000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="a", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=f"{MODEL}:7", max_tokens=2,
                                       messages=[{"role": "user", "content": "a"}])  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="is not an embedding model"):
        client.embeddings.create(model=MODEL, input="a")
    with pytest.raises(openai.AuthenticationError):
        platform.client("ek_wrong").completions.create(model=MODEL, prompt="a")
    for bad, needle in (("health", "reserved for probes"), ("urgent", "priority must be")):
        with pytest.raises(openai.BadRequestError, match=needle):
            client.completions.create(model=MODEL, prompt="a", max_tokens=2,
                                      extra_headers={"X-Ember-Priority": bad})  # fmt: skip
    tensor = {"name": "input", "shape": [1], "datatype": "BYTES", "data": ["a"]}
    v2 = platform.admin.post(f"/v2/models/{MODEL}/infer", content=json.dumps({"inputs": [tensor]}))
    assert v2.status_code == 400 and "use /openai/v1" in v2.json()["error"]


def test_gateway_metrics_count_the_llm_answers(platform: Platform) -> None:
    for _ in range(3):
        platform.client().completions.create(model=MODEL, prompt="a", max_tokens=2)
    metrics = platform.admin.get("/metrics").text
    ok = [line for line in metrics.splitlines()
          if line.startswith("ember_gateway_requests_total") and f'deployment="{MODEL}"' in line
          and 'outcome="ok"' in line]  # fmt: skip
    assert ok and float(ok[0].rsplit(" ", 1)[1]) >= 3


def test_the_prediction_log_records_llm_answers(platform: Platform) -> None:
    ids = {"plain": "llm-log-plain-0001", "stream": "llm-log-stream-0001"}
    platform.client().completions.create(
        model=MODEL, prompt="a", max_tokens=2, extra_headers={"X-Request-Id": ids["plain"]}
    )
    stream = platform.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        stream=True,
        extra_headers={"X-Request-Id": ids["stream"]},
    )
    assert list(stream)
    sha256 = platform.admin.get(f"/v1/models/{MODEL}/versions/1").json()["sha256"]

    def logged() -> list[dict[str, Any]]:
        lines: list[dict[str, Any]] = []
        for path in (platform.data_dir / "predictions").glob("predictions-*.jsonl"):
            lines += [json.loads(x) for x in path.read_text().splitlines()]
        return [r for r in lines if r["request_id"] in ids.values()]

    deadline = time.monotonic() + 30
    while len(logged()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    records = logged()
    assert sorted(r["request_id"] for r in records) == sorted(ids.values())
    for record in records:
        assert (record["model"], record["version"], record["status"]) == (MODEL, "1", 200)
        assert record["artifact_sha256"] == sha256 and len(record["output_digest"]) == 64
