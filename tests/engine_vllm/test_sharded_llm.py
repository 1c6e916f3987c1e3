"""A sharded checkpoint served by vLLM on a whole platform: the tiny Llama written by
transformers' ``save_pretrained(max_shard_size=...)`` (four shards, their index, config,
generation config, tokenizer) registered as a directory twice — from ``file://`` (version
1) and from an ``s3://`` prefix on a moto server (version 2) — deployed with the vLLM
engine (version 1 production, version 2 a canary) and answered through the official
``openai`` client on the gateway, each version pinned (``model:version``).

Both versions' replicas start at once (one vLLM start's wall time, not two); a second
replica of version 1, started last, loads from the cache the first one filled. What the
replicas loaded is read from their logs: the loader's ``weights loaded`` line (the vLLM
worker's, carrying model and version).
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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.domain.manifest import Manifest
from tests.services import background_job, free_port

openai = pytest.importorskip("openai", reason="pip install openai (the client side of these tests)")

ROOT = Path(__file__).resolve().parents[2]
VLLM_EMBER = ROOT / ".venv-vllm" / "bin" / "ember"
MAIN_EMBER = Path(sys.executable).with_name("ember")
START_TIMEOUT_S = float(os.environ.get("EMBER_TEST_VLLM_START_S", "300"))
ADMIN_KEY = "ek_test-sharded-llm-0123456789abc"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
MODEL, BUCKET = "tiny-sharded", "sharded-llm"
ENGINE_CONFIG = {"max_model_len": 256, "max_tokens": 8, "kv_cache_bytes": 64 * 1024**2}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@dataclass(frozen=True)
class Platform:
    url: str
    admin: httpx.Client
    proc: subprocess.Popen[bytes]
    log: Path
    data_dir: Path
    checkpoint: Path

    def client(self) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/openai/v1", api_key=ADMIN_KEY, max_retries=0,
                             timeout=120)  # fmt: skip

    def replicas(self, version: str) -> list[dict[str, Any]]:
        got = self.admin.get(f"/v1/deployments/{MODEL}/replicas").json()
        return [r for r in got["replicas"] if r["version"] == version]

    def wait(self, check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the API exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                if check():
                    return
            time.sleep(1)
        pytest.fail(f"{what}: not within {START_TIMEOUT_S:.0f} s\n{self.tail()}")

    def ready(self, version: str, count: int = 1) -> bool:
        replicas = self.replicas(version)
        if any(r["state"] == "failed" for r in replicas):
            pytest.fail(f"a replica of version {version} failed:\n{self.replica_logs()}")
        return sum(1 for r in replicas if r["state"] == "ready") >= count

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] + self.replica_logs()

    def replica_logs(self) -> str:
        logs = sorted((self.data_dir / "replicas").glob("*.log"))
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)

    def load_report(self, replica_id: str) -> dict[str, Any]:
        """The loader's ``weights loaded`` line in that replica's log (its vLLM worker's)."""
        log = self.data_dir / "replicas" / f"{replica_id}.log"
        lines: list[dict[str, Any]] = [
            json.loads(x)
            for x in log.read_text(errors="replace").splitlines()
            if x.startswith("{") and '"weights loaded"' in x
        ]
        assert len(lines) == 1, f"one load per replica:\n{log.read_text()[-4000:]}"
        return lines[0]


def _require_vllm_venv() -> None:
    built = background_job("vllm-venv")  # `make test` builds it while the other suites run
    if built is not None and built[0] != 0:
        pytest.fail(f"scripts/vllm-venv.sh exited {built[0]}:\n{built[1][-6000:]}")
    if not VLLM_EMBER.exists():
        pytest.skip(".venv-vllm is absent: build it with scripts/vllm-venv.sh (make test does)")


def _upload(checkpoint: Path, endpoint: str, prefix: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=BUCKET)
    for path in sorted(checkpoint.iterdir()):
        s3.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")


def _stop(proc: subprocess.Popen[bytes], pids: set[int]) -> None:
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


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Platform]:
    from ember.engine.examples.tiny_llm import build_tiny_llm

    _require_vllm_venv()
    moto_endpoint: str = request.getfixturevalue("moto_endpoint")  # only where it will run
    root = tmp_path_factory.mktemp("sharded-llm")
    data_dir = root / "ember-data"
    checkpoint = build_tiny_llm(data_dir / "objects" / MODEL / "1", sharded=True)
    _upload(checkpoint, moto_endpoint, f"{MODEL}/2")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env |= {"EMBER_DATA_DIR": str(data_dir), "EMBER_ADMIN_KEY": ADMIN_KEY,
            "EMBER_HOST": "127.0.0.1", "EMBER_PORT": str(port), "EMBER_STANDBY_REPLICAS": "0",
            "EMBER_S3_ENDPOINT_URL": moto_endpoint, "EMBER_S3_ALLOWED_BUCKETS": BUCKET,
            "EMBER_LOG_FORMAT": "json", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    log = root / "api.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(MAIN_EMBER), "serve"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    admin = httpx.Client(base_url=url, headers=AUTH, timeout=60)
    platform = Platform(url, admin, proc, log, data_dir, checkpoint)
    pids: set[int] = set()
    try:
        platform.wait(lambda: httpx.get(f"{url}/readyz").status_code == 200, "the API")
        assert admin.post("/v1/models", json={"name": MODEL}).status_code == 201
        for version, uri in (("1", checkpoint.as_uri() + "/"), ("2", f"s3://{BUCKET}/{MODEL}/2/")):
            body = {"version": version, "artifact_uri": uri, "engine": "vllm",
                    "engine_config": ENGINE_CONFIG}  # fmt: skip
            created = admin.post(f"/v1/models/{MODEL}/versions", json=body)
            assert created.status_code == 201, created.text
        deployed = admin.post("/v1/deployments", json={"model": MODEL, "version": "1"})
        assert deployed.status_code == 201, deployed.text
        canary = admin.post(f"/v1/deployments/{MODEL}:canary", json={"version": "2"})
        assert canary.status_code == 200, canary.text  # both versions' replicas start now

        def both_ready() -> bool:
            for version in "12":
                pids.update(r["pid"] for r in platform.replicas(version) if r["pid"])
            return platform.ready("1") and platform.ready("2")

        platform.wait(both_ready, "the vLLM replicas of both versions")
        yield platform
        for version in "12":  # the replica started by the last test, too
            with contextlib.suppress(httpx.HTTPError):
                pids.update(r["pid"] for r in platform.replicas(version) if r["pid"])
    finally:
        admin.close()
        _stop(proc, pids)
        print(f"api log: {log}", file=sys.stderr)


def test_each_registration_is_the_manifest_of_the_directory(platform: Platform) -> None:
    names = sorted(p.name for p in platform.checkpoint.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) >= 3 and "model.safetensors.index.json" in names
    for version in ("1", "2"):
        got = platform.admin.get(f"/v1/models/{MODEL}/versions/{version}").json()
        assert got["status"] == "ready", got
        assert [f["path"] for f in got["files"]] == names
        for f in got["files"]:
            raw = (platform.checkpoint / f["path"]).read_bytes()
            assert (f["size"], f["sha256"]) == (len(raw), hashlib.sha256(raw).hexdigest())
        assert got["sha256"] == Manifest.of(got["files"]).digest
        index = json.loads((platform.checkpoint / "model.safetensors.index.json").read_text())
        assert got["tensor_count"] == len(index["weight_map"])
    # The same bytes from either store: the same manifest, so the same identity.
    one, two = (platform.admin.get(f"/v1/models/{MODEL}/versions/{v}").json() for v in "12")
    assert one["sha256"] == two["sha256"] and one["artifact_uri"] != two["artifact_uri"]


def test_both_versions_answer_alike_through_the_gateway(platform: Platform) -> None:
    client = platform.client()
    texts = []
    for version in "12":
        raw = client.completions.with_raw_response.create(
            model=f"{MODEL}:{version}", prompt="The loader streams", max_tokens=6,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert raw.headers["x-ember-version"] == version
        out = raw.parse()
        assert out.usage is not None and out.usage.completion_tokens == 6
        texts.append(out.choices[0].text)
    assert texts[0] and texts[0] == texts[1]  # greedy on the same weights: the same tokens
    chat = client.chat.completions.create(
        model=f"{MODEL}:2", messages=[{"role": "user", "content": "Every shard arrives."}],
        max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].message.content and chat.usage is not None
    assert chat.usage.completion_tokens == 4


def _shard_bytes(platform: Platform) -> int:
    return sum(p.stat().st_size for p in platform.checkpoint.glob("*.safetensors"))


def test_the_shards_came_through_embers_loader_from_each_store(platform: Platform) -> None:
    sha256 = platform.admin.get(f"/v1/models/{MODEL}/versions/1").json()["sha256"]
    index = json.loads((platform.checkpoint / "model.safetensors.index.json").read_text())
    for version, source in (
        ("1", platform.checkpoint.as_uri() + "/"),
        ("2", f"s3://{BUCKET}/{MODEL}/2/"),
    ):
        (replica,) = platform.replicas(version)
        report = platform.load_report(replica["replica_id"])
        assert (report["model"], report["version"], report["source"]) == (MODEL, version, source)
        assert report["sha256"] == sha256 and report["device"] == "cpu"
        assert report["cache"] == "miss"  # store -> NVMe cache -> vLLM's worker, in one pass
        assert report["bytes_fetched"] == _shard_bytes(platform)  # every shard, once
        assert report["tensors"] == len(index["weight_map"])
        assert report["bytes"] == index["metadata"]["total_size"]
    # One verified cache entry per file of each version (shards and sidecars alike).
    entries = list((platform.data_dir / "cache").rglob(f"{sha256}/f/*/weights.*"))
    files = len(list(platform.checkpoint.iterdir()))
    assert len(entries) == 2 * files, entries


def test_a_second_replica_loads_the_shards_from_the_cache(platform: Platform) -> None:
    (first,) = platform.replicas("1")
    patched = platform.admin.patch(f"/v1/deployments/{MODEL}", json={"min_hot": 2})
    assert patched.status_code == 200, patched.text  # production (version 1): two replicas
    platform.wait(lambda: platform.ready("1", 2), "a second replica of version 1")
    (second,) = [r for r in platform.replicas("1") if r["replica_id"] != first["replica_id"]]
    report = platform.load_report(second["replica_id"])
    assert (report["model"], report["version"]) == (MODEL, "1")
    assert report["cache"] == "hit" and report["bytes_fetched"] == 0
    assert report["bytes"] == platform.load_report(first["replica_id"])["bytes"]
    client = platform.client()

    def complete(_: int) -> tuple[str, str]:
        raw = client.completions.with_raw_response.create(
            model=f"{MODEL}:1", prompt="The loader streams", max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return raw.headers["x-ember-replica"], raw.parse().choices[0].text

    with ThreadPoolExecutor(8) as pool:  # at once: least in-flight spreads them over both
        seen = set(pool.map(complete, range(8)))
    assert {replica for replica, _ in seen} == {first["replica_id"], second["replica_id"]}
    assert len({text for _, text in seen}) == 1  # the same weights in both replicas


def test_the_sharded_example_is_the_single_file_model_split(tmp_path: Path) -> None:
    """No vLLM needed: the example's two layouts hold the same tensors (same seed)."""
    from safetensors.torch import load_file

    from ember.engine.examples.tiny_llm import build_tiny_llm

    whole = load_file(build_tiny_llm(tmp_path / "whole") / "model.safetensors")
    folder = build_tiny_llm(tmp_path / "sharded", sharded=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) >= 3 and sorted(set(index["weight_map"].values())) == [
        p.name for p in shards
    ]
    parts = {name: t for p in shards for name, t in load_file(p).items()}
    assert parts.keys() == whole.keys() == index["weight_map"].keys()
    assert all(parts[n].equal(whole[n]) for n in whole)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (folder / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
