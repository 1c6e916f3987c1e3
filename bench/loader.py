"""Weight-loading bench: Ember's loader against the best public loaders, side by side.

Run by hand (not by the test suite)::

    .venv/bin/python bench/loader.py [--size-gib 2.2] [--runs 5] [--device cpu|cuda]

It writes a >= 2 GiB safetensors file with a realistic tensor mix (hundreds of tensors,
bf16/fp16/fp32, KBs to ~200 MB) and loads it with every loader in two modes:

* **to-device**: every tensor ends in preallocated destination memory (on CUDA the real
  device, on CPU a preallocated, touched buffer standing in for it);
* **resident**: tensors in host memory with every page touched (a lazy mmap is not loaded).

each **cold** (the file's pages dropped with ``posix_fadvise(DONTNEED)``, checked with
``mincore``) and **warm** (every page resident, checked too); runs are interleaved and
figures are medians. The same run measures the limits: O_DIRECT multi-threaded
sequential read of the file (disk), a page-cache read, and memcpy. With ``--s3`` it also
times ``s3://`` (a local moto server) -> device and cache hit -> device for a 200 MB
artifact. It prints a table, then as its last line one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ember.config import Settings
from ember.loader import pagecache
from ember.loader.load import WeightLoader, load_file

GB = 1e9
Loader = Callable[[Path, dict[str, torch.Tensor] | None], dict[str, torch.Tensor] | None]


# --- the artifact --------------------------------------------------------------------
def tensor_mix(size_gib: float) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """A decoder-style model: a ~200 MB embedding, per-layer bf16 matrices of 8-25 MB,
    fp32 norms and routers (KBs), fp16 biases — layers added until the size is reached."""
    hidden, inter, vocab = 2048, 5632, 50_000
    mix: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "embed_tokens.weight": ((vocab, hidden), torch.bfloat16),  # 205 MB
    }
    total, layer = vocab * hidden * 2, 0
    while total < size_gib * 1024**3:
        p = f"layers.{layer}."
        entries = {
            p + "self_attn.qkv_proj.weight": ((3 * hidden, hidden), torch.bfloat16),
            p + "self_attn.qkv_proj.bias": ((3 * hidden,), torch.float16),
            p + "self_attn.o_proj.weight": ((hidden, hidden), torch.bfloat16),
            p + "mlp.gate_proj.weight": ((inter, hidden), torch.bfloat16),
            p + "mlp.up_proj.weight": ((inter, hidden), torch.bfloat16),
            p + "mlp.down_proj.weight": ((hidden, inter), torch.float16),
            p + "mlp.router.weight": ((64, hidden), torch.float32),
            p + "input_layernorm.weight": ((hidden,), torch.float32),
            p + "post_attention_layernorm.weight": ((hidden,), torch.float32),
        }
        for name, (shape, dtype) in entries.items():
            mix[name] = (shape, dtype)
            total += _numel(shape) * dtype.itemsize
        layer += 1
    mix["norm.weight"] = ((hidden,), torch.float32)
    mix["lm_head.weight"] = ((vocab // 4, hidden), torch.float32)
    return mix


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_artifact(path: Path, size_gib: float) -> None:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (shape, dtype) in tensor_mix(size_gib).items():
        raw = torch.randint(0, 255, (_numel(shape) * dtype.itemsize,), dtype=torch.uint8,
                            generator=gen)  # fmt: skip
        tensors[name] = raw.view(dtype).reshape(shape)
    save_file(tensors, str(path))


# --- page cache state ----------------------------------------------------------------
def make_cold(path: Path) -> None:
    gc.collect()
    pagecache.drop(path)
    frac = pagecache.resident_fraction(path)
    if frac > 0.01:
        raise RuntimeError(f"could not drop {path} from the page cache ({frac:.1%} resident)")


def make_warm(path: Path) -> None:
    gc.collect()  # the previous load's tensors must not squeeze the page cache
    frac = 0.0
    for _ in range(3):
        with path.open("rb", buffering=0) as fh:
            buf = bytearray(16 * 1024 * 1024)
            while fh.readinto(buf):
                pass
        frac = pagecache.resident_fraction(path)
        if frac >= 0.99:
            return
    print(f"# warning: {path.name} only {frac:.1%} resident after reading it", file=sys.stderr)


def touch_pages(tensors: dict[str, torch.Tensor]) -> int:
    """Read every byte of every tensor (a lazy mapping is not "loaded")."""
    acc = 0
    for t in tensors.values():
        raw = t.reshape(-1).view(torch.uint8)
        n8 = raw.numel() // 8 * 8
        arr = raw.numpy()  # numpy: one pass, no temporary, no OpenMP pool left spinning
        if n8:
            acc ^= int(arr[:n8].view("u8").max())
        if raw.numel() > n8:
            acc ^= int(arr[n8:].max())
    return acc


# --- loaders -------------------------------------------------------------------------
def _copy_into(dest: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> None:
    dest[name].copy_(t)


def ember_loader(settings: Settings) -> Loader:
    def run(path: Path, dest: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        tensors = load_file(path, into=dest, settings=settings).tensors
        # to-device: the bytes are in the caller's (touched) buffers, as with every peer;
        # returning them would make the bench read them again for Ember alone.
        return tensors if dest is None else None

    return run


def safetensors_loader(path: Path, dest: dict[str, torch.Tensor] | None) -> Any:
    from safetensors import safe_open
    from safetensors.torch import load_file as st_load

    if dest is None:
        return st_load(str(path), device="cpu")
    with safe_open(str(path), "pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            _copy_into(dest, name, f.get_tensor(name))
    return None


def runai_loader(direct: bool) -> Loader:
    def run(path: Path, dest: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        from runai_model_streamer import SafetensorsStreamer

        out: dict[str, torch.Tensor] = {}
        with SafetensorsStreamer() as s:
            s.stream_file(str(path), device="cpu")
            for name, t in s.get_tensors():
                if dest is None:
                    out[name] = t.clone()  # its buffers are reused: keep a real copy
                else:
                    _copy_into(dest, name, t)
        return out if dest is None else None

    return run


def fastsafetensors_loader(path: Path, dest: dict[str, torch.Tensor] | None) -> Any:
    from fastsafetensors import fastsafe_open

    out = {}
    with fastsafe_open(filenames=[str(path)], nogds=True, device="cpu") as f:
        for name in f.keys():  # noqa: SIM118
            t = f.get_tensor(name)
            if dest is None:
                out[name] = t.clone()  # its buffer is freed on close
            else:
                _copy_into(dest, name, t)
    return out if dest is None else None


def tensorizer_loader(tpath: Path) -> Loader:
    def run(path: Path, dest: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        from tensorizer import TensorDeserializer

        with TensorDeserializer(str(tpath), device="cpu", lazy_load=False) as d:
            if dest is None:
                return dict(d.items())
            for name, t in d.items():
                _copy_into(dest, name, t)
        return None

    return run


OWN_FILES: dict[str, Path] = {}
"""Loaders that read their own file (tensorizer's format) instead of the artifact: that
file is made cold or warm before their runs, as the artifact is for the others."""


def available_peers(work: Path, artifact: Path) -> dict[str, Loader]:
    peers: dict[str, Loader] = {"safetensors": safetensors_loader}
    try:
        import runai_model_streamer  # noqa: F401

        peers["runai"] = runai_loader(True)  # its default: O_DIRECT reads (io_uring)
    except ImportError:
        print("# runai-model-streamer not installed: skipped", file=sys.stderr)
    try:
        import fastsafetensors  # noqa: F401

        peers["fastsafetensors"] = fastsafetensors_loader
    except ImportError:
        print("# fastsafetensors not installed: skipped", file=sys.stderr)
    try:
        from safetensors.torch import load_file as st_load
        from tensorizer import TensorSerializer

        tpath = work / "artifact.tensors"
        if not tpath.exists():
            ser = TensorSerializer(str(tpath))
            ser.write_state_dict(st_load(str(artifact)))
            ser.close()
        peers["tensorizer"] = tensorizer_loader(tpath)
        OWN_FILES["tensorizer"] = tpath
    except ImportError:
        print("# tensorizer not installed: skipped", file=sys.stderr)
    return peers


# --- limits --------------------------------------------------------------------------
def buffered_read(path: Path) -> None:
    buf = bytearray(16 * 1024 * 1024)
    with path.open("rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass


_memcpy_bufs: list[torch.Tensor] = []


def memcpy(nbytes: int) -> None:
    if not _memcpy_bufs:
        _memcpy_bufs.extend(torch.ones(nbytes, dtype=torch.uint8) for _ in range(2))
    _memcpy_bufs[1].copy_(_memcpy_bufs[0])


# --- measuring -----------------------------------------------------------------------
def measure(fn: Callable[[], Any]) -> tuple[float, float]:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    return t1 - t0, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=2.2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ember-bench")
    ap.add_argument("--peers", default="all", help="comma-separated names, or all / none")
    ap.add_argument("--modes", default="to-device,resident")
    ap.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()

    work: Path = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    artifact = work / f"artifact-{args.size_gib:g}g.safetensors"
    if not artifact.exists():
        print(f"# writing {artifact} ...", file=sys.stderr)
        make_artifact(artifact, args.size_gib)
    size = artifact.stat().st_size
    settings = Settings(data_dir=work / "ember-data")
    loaders: dict[str, Loader] = {"ember": ember_loader(settings)}
    if args.peers != "none":
        peers = available_peers(work, artifact)
        wanted = set(peers) if args.peers == "all" else set(args.peers.split(","))
        loaders.update({k: v for k, v in peers.items() if k in wanted})
    from safetensors import safe_open

    with safe_open(str(artifact), "pt") as f:
        names = list(f.keys())
        meta = {n: (f.get_slice(n).get_shape(), f.get_slice(n).get_dtype()) for n in names}
    from ember.loader.device import torch_dtypes

    dt = torch_dtypes()
    dest = {n: torch.ones(s, dtype=dt[d]) for n, (s, d) in meta.items()}  # touched once
    data_bytes = sum(t.nbytes for t in dest.values())
    print(f"# {artifact.name}: {size / GB:.2f} GB, {len(dest)} tensors, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}", file=sys.stderr)  # fmt: skip

    memcpy(1 << 30)  # allocate and touch the memcpy buffers outside the measurement
    # No gc.freeze() here (``ember engine`` does one after its imports): with it, tensorizer's
    # deserializer leaked 2.4 GB per load. make_cold/make_warm run a full collection right
    # before every load instead, so no loader's run pays for another's garbage.
    results: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    limits: dict[str, list[tuple[float, float]]] = {"disk O_DIRECT": [], "page cache": [],
                                                    "memcpy": []}  # fmt: skip
    modes = args.modes.split(",")
    skipped: set[str] = set()
    for run in range(args.runs):
        for temp in ("cold", "warm"):
            for name, fn in loaders.items():
                for mode in modes:
                    (make_cold if temp == "cold" else make_warm)(OWN_FILES.get(name, artifact))
                    target = dest if mode == "to-device" else None

                    def once(fn: Loader = fn, target: Any = target) -> None:
                        out = fn(artifact, target)
                        touch_pages(out if out is not None else {})

                    results.setdefault((name, mode, temp), []).append(measure(once))
        make_cold(artifact)
        limits["disk O_DIRECT"].append(measure(lambda: pagecache.read_direct(artifact)))
        make_warm(artifact)
        limits["page cache"].append(measure(lambda: buffered_read(artifact)))
        limits["memcpy"].append(measure(lambda: memcpy(1 << 30)))
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE
        print(f"# run {run + 1}/{args.runs} done (RSS {rss / GB:.2f} GB)", file=sys.stderr)
        # tensorizer 2.12 keeps ~the artifact's size alive per load in this process (not
        # freed by del + gc.collect): stop running it before the bench is OOM-killed; its
        # medians then come from the runs it had.
        if "tensorizer" in loaders and rss > 0.45 * os.sysconf("SC_PHYS_PAGES") * mmap.PAGESIZE:
            del loaders["tensorizer"]
            skipped.add("tensorizer")
            print("# tensorizer leaks memory per load: dropped from the later runs",
                  file=sys.stderr)  # fmt: skip

    def gbps(samples: list[tuple[float, float]], nbytes: int) -> float:
        return nbytes / statistics.median(s[0] for s in samples) / GB

    def cpu_per_gb(samples: list[tuple[float, float]], nbytes: int) -> float:
        return statistics.median(s[1] for s in samples) / (nbytes / GB)

    print(f"\n{'loader':18} {'mode':10} {'cold GB/s':>10} {'warm GB/s':>10} "
          f"{'CPU-s/GB cold':>14} {'CPU-s/GB warm':>14}")  # fmt: skip
    fig: dict[str, dict[str, float]] = {}
    names = list(dict.fromkeys(name for name, _, _ in results))  # dropped loaders too
    for mode in modes:
        for name in names:
            c, w = results[(name, mode, "cold")], results[(name, mode, "warm")]
            row = {
                "cold": gbps(c, data_bytes),
                "warm": gbps(w, data_bytes),
                "cpu_cold": cpu_per_gb(c, data_bytes),
                "cpu_warm": cpu_per_gb(w, data_bytes),
            }
            fig[f"{name}/{mode}"] = row
            print(f"{name:18} {mode:10} {row['cold']:10.2f} {row['warm']:10.2f} "
                  f"{row['cpu_cold']:14.3f} {row['cpu_warm']:14.3f}")  # fmt: skip
    lim = {
        "disk_odirect": gbps(limits["disk O_DIRECT"], size),
        "page_cache": gbps(limits["page cache"], size),
        "memcpy": gbps(limits["memcpy"], 1 << 30),
    }
    print(f"limits: disk O_DIRECT {lim['disk_odirect']:.2f}, page-cache read "
          f"{lim['page_cache']:.2f}, memcpy {lim['memcpy']:.2f} GB/s")  # fmt: skip

    s3 = s3_figures(work, settings) if args.s3 else {}
    for k, v in s3.items():
        print(f"{k}: {v:.3f}")

    def best_peer(temp: str) -> float:
        vals = [fig[f"{n}/to-device"][temp] for n in names if n != "ember"]
        return max(vals) if vals else float("nan")

    ember = fig["ember/to-device"]
    summary = {
        "ember_vs_best_peer_cold": ember["cold"] / best_peer("cold"),
        "ember_vs_best_peer_warm": ember["warm"] / best_peer("warm"),
        "ember_vs_safetensors_cold": ember["cold"] / fig["safetensors/to-device"]["cold"]
        if "safetensors" in names
        else float("nan"),
        "ember_vs_limit_cold": ember["cold"] / lim["disk_odirect"],
        "ember_vs_memcpy_warm": ember["warm"] / lim["memcpy"],
        "ember_cpu_s_per_gb": ember["cpu_cold"],
        "ember_cpu_s_per_gb_warm": ember["cpu_warm"],
        "ember_cold_gbps": ember["cold"],
        "ember_warm_gbps": ember["warm"],
        "limits_gbps": lim,
        "staging_bytes": settings.loader_staging_bytes,
        "runs": args.runs,
        "artifact_bytes": size,
        "tensors": len(dest),
        **s3,
        "loaders": {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in fig.items()},
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))


def s3_figures(work: Path, settings: Settings) -> dict[str, float]:
    """s3:// (moto) -> device on a miss, and cache hit -> device, for a 200 MB artifact."""
    import socket

    import boto3
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    path = work / "artifact-200m.safetensors"
    if not path.exists():
        make_artifact(path, 0.19)
    sha = _sha256(path)
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/moto-api/").status_code < 500:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
        s3.create_bucket(Bucket="bench")
        s3.upload_file(str(path), "bench", "m.safetensors")
        cfg = settings.model_copy(update={"s3_endpoint_url": url, "s3_allowed_buckets": ["*"],
                                          "cache_dir": work / "s3-cache"})  # fmt: skip
        shutil.rmtree(work / "s3-cache", ignore_errors=True)
        loader = WeightLoader(cfg)
        uri = "s3://bench/m.safetensors"
        miss = loader.load("bench", "1", uri, sha)
        assert miss.report.cache == "miss"
        entry = loader.cache.weights_path(miss.pin.key)  # type: ignore[union-attr]
        make_cold(entry)
        hit_cold = loader.load("bench", "1", uri, sha)
        make_warm(entry)
        hit_warm = loader.load("bench", "1", uri, sha)
        for w in (miss, hit_cold, hit_warm):
            if w.pin:
                w.pin.release()
        return {
            "s3_miss_to_device_s": miss.report.seconds,
            "s3_miss_to_device_gbps": miss.report.gbps,
            "cache_hit_cold_to_device_s": hit_cold.report.seconds,
            "cache_hit_cold_to_device_gbps": hit_cold.report.gbps,
            "cache_hit_warm_to_device_s": hit_warm.report.seconds,
            "cache_hit_warm_to_device_gbps": hit_warm.report.gbps,
        }
    finally:
        proc.terminate()
        proc.wait(10)


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(16 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


if __name__ == "__main__":
    main()
