"""Weight-loading bench: Ember's loader against the best public loaders, side by side.

Run by hand (not by the test suite)::

    .venv/bin/python bench/loader.py [--size-gib 2.2] [--runs 5] [--device cpu|cuda]
                                     [--only single|sharded] [--shards 4]

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
artifact.

**The sharded case** (``--only sharded`` runs it alone): the same tensor mix split the way
``save_pretrained`` splits it (``huggingface_hub``'s splitter, ``--shards`` files of at most
total / shards bytes, ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
+ ``config.json``) in a ``file://`` object store, loaded to the device (preallocated
destinations, as above) by

* **Ember**: ``WeightLoader.load_version`` of the directory version through the NVMe cache:
  cold = a cache miss (entries evicted, the store's shards dropped from the page cache: the
  store's bytes go to the cache file and the device in one pass, each verified), warm = a
  hit with the entries resident; and **Ember, NVMe hit**: a hit with the entries' pages
  dropped (what a replica restarting on the same host gets);
* **safetensors**: ``load_file`` per shard, each tensor copied into its destination;
* **Run:ai Model Streamer**: one ``SafetensorsStreamer.stream_files([...every shard])``
  (it reads the shards concurrently), each tensor copied into its destination;

cold and warm, interleaved in the same runs; the limits are an O_DIRECT read of all shards
(4 threads over their 16 MiB chunks), a page-cache read of them, and memcpy; and what bounds
a miss besides the read: sha256 on one thread, a buffered write + fsync of 1 GiB in the
cache's directory. ``--only all`` (the default) runs each case in a process of its own. It
prints a table, then as its last line one JSON object (the sharded figures: ``sharded_*``).
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
from ember.domain.manifest import Manifest, ManifestFile
from ember.domain.spec import VersionSpec
from ember.loader import pagecache
from ember.loader.cache import CacheKey
from ember.loader.load import WeightLoader, load_file
from ember.logs import configure_logging

GB = 1e9
Loader = Callable[[Path, dict[str, torch.Tensor] | None], dict[str, torch.Tensor] | None]
Samples = dict[tuple[str, str], list[tuple[float, float]]]
"""(loader, cold or warm) -> (wall seconds, CPU seconds) of each run."""


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


def mix_tensors(size_gib: float) -> dict[str, torch.Tensor]:
    """``tensor_mix`` filled with seeded random bytes."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (shape, dtype) in tensor_mix(size_gib).items():
        raw = torch.randint(0, 255, (_numel(shape) * dtype.itemsize,), dtype=torch.uint8,
                            generator=gen)  # fmt: skip
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors


def make_artifact(path: Path, size_gib: float) -> None:
    from safetensors.torch import save_file

    save_file(mix_tensors(size_gib), str(path))


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

        tpath = artifact.with_suffix(".tensors")  # one per artifact (size)
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


_h2d_bufs: list[torch.Tensor] = []


def h2d(nbytes: int, device: str) -> None:
    """Pinned host memory to the device: the bound of a warm load onto a GPU."""
    if not _h2d_bufs:
        _h2d_bufs.append(torch.ones(nbytes, dtype=torch.uint8).pin_memory())
        _h2d_bufs.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
    _h2d_bufs[1].copy_(_h2d_bufs[0], non_blocking=True)
    torch.cuda.synchronize()


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
    ap.add_argument("--device", default="cpu", help="where to-device loads land: cpu, cuda")
    ap.add_argument("--only", choices=("all", "single", "sharded"), default="all",
                    help="run only the single-file case or only the sharded one")  # fmt: skip
    ap.add_argument("--shards", type=int, default=4, help="sharded case: at least this many")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no CUDA device")
    if args.shards < 1:
        ap.error("--shards must be at least 1")

    configure_logging("WARNING")  # the loader's per-load lines would bury the tables
    work: Path = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    settings = Settings(data_dir=work / "ember-data")
    summary: dict[str, Any] = {"device": args.device}
    if args.only == "all":  # each case in a process of its own: neither's memory (tensorizer
        for case in ("single", "sharded"):  # leaks per load) squeezes the other's
            summary |= run_case(case)
    elif args.only == "single":
        summary |= single_case(args, work, settings)
    else:
        summary |= sharded_case(args, work, settings)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))


def run_case(case: str) -> dict[str, Any]:
    """This bench with the same arguments and ``--only case``: its output passed through,
    its JSON line returned."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--only", case]
    last = ""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if last:
                print(last, end="", flush=True)
            last = line
    if proc.returncode != 0 or not last.startswith("{"):
        print(last, end="")
        raise SystemExit(f"bench/loader.py --only {case} exited {proc.returncode}")
    out: dict[str, Any] = json.loads(last)
    return out


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE


def on_device(device: str) -> Callable[[], None]:
    """What ends a to-device load's timing: on CUDA, the copies queued on the device."""
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def single_case(args: argparse.Namespace, work: Path, settings: Settings) -> dict[str, Any]:
    """One >= 2 GiB file, every loader, both modes; the figures the JSON line has always had."""
    artifact = work / f"artifact-{args.size_gib:g}g.safetensors"
    if not artifact.exists():
        print(f"# writing {artifact} ...", file=sys.stderr)
        make_artifact(artifact, args.size_gib)
    size = artifact.stat().st_size
    sync = on_device(args.device)
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
    dest = {n: torch.ones(s, dtype=dt[d], device=args.device)
            for n, (s, d) in meta.items()}  # touched once  # fmt: skip
    data_bytes = sum(t.nbytes for t in dest.values())
    print(f"# {artifact.name}: {size / GB:.2f} GB, {len(dest)} tensors, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, to {args.device}",
          file=sys.stderr)  # fmt: skip

    memcpy(1 << 30)  # allocate and touch the memcpy buffers outside the measurement
    # No gc.freeze() here (``ember engine`` does one after its imports): with it, tensorizer's
    # deserializer leaked 2.4 GB per load. make_cold/make_warm run a full collection right
    # before every load instead, so no loader's run pays for another's garbage.
    results: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    limits: dict[str, list[tuple[float, float]]] = {"disk O_DIRECT": [], "page cache": [],
                                                    "memcpy": []}  # fmt: skip
    modes = args.modes.split(",")
    skipped: set[str] = set()
    rss_before = _rss()
    for run in range(args.runs):
        for temp in ("cold", "warm"):
            for name, fn in loaders.items():
                for mode in modes:
                    (make_cold if temp == "cold" else make_warm)(OWN_FILES.get(name, artifact))
                    target = dest if mode == "to-device" else None

                    def once(fn: Loader = fn, target: Any = target) -> None:
                        out = fn(artifact, target)
                        sync()
                        touch_pages(out if out is not None else {})

                    results.setdefault((name, mode, temp), []).append(measure(once))
        make_cold(artifact)
        limits["disk O_DIRECT"].append(measure(lambda: pagecache.read_direct(artifact)))
        make_warm(artifact)
        limits["page cache"].append(measure(lambda: buffered_read(artifact)))
        limits["memcpy"].append(measure(lambda: memcpy(1 << 30)))
        if args.device.startswith("cuda"):
            limits.setdefault("h2d", []).append(measure(lambda: h2d(1 << 30, args.device)))
        rss = _rss()
        print(f"# run {run + 1}/{args.runs} done (RSS {rss / GB:.2f} GB)", file=sys.stderr)
        # tensorizer 2.12 keeps ~the artifact's size alive per load in this process (not
        # freed by del + gc.collect): stop running it before the bench is OOM-killed (before
        # a run that would grow the RSS as much as this one did no longer fits: the host's
        # other processes count too); its medians then come from the runs it had.
        grown, rss_before = rss - rss_before, rss
        available = pagecache.available_bytes()
        phys = os.sysconf("SC_PHYS_PAGES") * mmap.PAGESIZE
        short = available is not None and available < grown + 2 * size
        if "tensorizer" in loaders and (rss + grown > 0.45 * phys or short):
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
    if "h2d" in limits:
        lim["h2d_pinned"] = gbps(limits["h2d"], 1 << 30)
    h2d_s = f", pinned host-to-device {lim['h2d_pinned']:.2f}" if "h2d_pinned" in lim else ""
    print(f"limits: disk O_DIRECT {lim['disk_odirect']:.2f}, page-cache read "
          f"{lim['page_cache']:.2f}, memcpy {lim['memcpy']:.2f} GB/s{h2d_s}")  # fmt: skip

    s3 = s3_figures(work, settings, args.device) if args.s3 else {}
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
        **({"ember_vs_h2d_warm": ember["warm"] / lim["h2d_pinned"]} if "h2d_pinned" in lim else {}),
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
    return summary


# --- the sharded case ----------------------------------------------------------------
SHARDED_MODEL, SHARDED_VERSION = "bench-sharded", "1"
INDEX = "model.safetensors.index.json"


def make_sharded(folder: Path, size_gib: float, shards: int) -> None:
    """``mix_tensors`` as ``save_pretrained`` writes a large model: ``huggingface_hub``'s
    splitter (tensors in order, a new shard when the next would pass ``max_shard_size`` =
    total / shards), ``model-0000i-of-0000n.safetensors`` files, the index and a config.
    Written beside ``folder`` and renamed into place: a half-written one is never reused."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tensors = mix_tensors(size_gib)
    total = sum(t.nbytes for t in tensors.values())
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=-(-total // shards))
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, str(tmp / filename), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": split.tensor_to_filename}
    (tmp / INDEX).write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps({"model_type": "bench", "size_gib": size_gib}))
    os.replace(tmp, folder)


def sharded_spec(folder: Path, manifest_file: Path) -> VersionSpec:
    """The directory as a registered version: its manifest (every file's size and sha256,
    hashed once and kept beside it) and the manifest's digest as the version's sha256."""
    if manifest_file.exists():
        manifest = Manifest.model_validate_json(manifest_file.read_text())
    else:
        manifest = Manifest.of(
            ManifestFile(path=p.name, size=p.stat().st_size, sha256=_sha256(p))
            for p in sorted(folder.iterdir())
        )
        manifest_file.write_text(manifest.model_dump_json())
    return VersionSpec(model=SHARDED_MODEL, version=SHARDED_VERSION,
                       artifact_uri=folder.as_uri() + "/", sha256=manifest.digest,
                       files=manifest.files, engine="torch")  # fmt: skip


def read_direct_all(paths: list[Path], threads: int = 4, chunk: int = 16 * 1024 * 1024) -> int:
    """O_DIRECT reads of every file, ``threads`` threads taking the 16 MiB chunks of all of
    them in order (the disk's limit for the whole checkpoint, no copy at all)."""
    import threading

    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
    work = iter([(fd, off) for fd, p in zip(fds, paths, strict=True)
                 for off in range(0, p.stat().st_size, chunk)])  # fmt: skip
    bufs = [pagecache.host_buffer(chunk, populate=True) for _ in range(threads)]
    lock, got = threading.Lock(), [0] * threads

    def run(i: int) -> None:
        while True:
            with lock:
                item = next(work, None)
            if item is None:
                return
            got[i] += os.preadv(item[0], [bufs[i]], item[1])

    try:
        pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        for fd in fds:
            os.close(fd)
    return sum(got)


SHA256_BYTES = 256 * 1024 * 1024
_sha256_buf: list[bytes] = []


def sha256_once() -> None:
    """One thread hashing 256 MiB in memory: what verifying a miss costs per byte."""
    import hashlib

    if not _sha256_buf:
        _sha256_buf.append(os.urandom(SHA256_BYTES))
    hashlib.sha256(_sha256_buf[0]).digest()


WRITE_BYTES = 1 << 30


def write_fsync(folder: Path) -> None:
    """1 GiB written through the page cache and fsync'd, in the cache's directory: what a
    cache fill does with the bytes it fetches."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".bench-write-{os.getpid()}"
    chunk = b"\x5a" * (16 * 1024 * 1024)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for off in range(0, WRITE_BYTES, len(chunk)):
            os.pwrite(fd, chunk, off)
        os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink()


class ShardedLoads:
    """The sharded case's loaders: each ``prepare(temp)`` sets the page cache (and Ember's
    cache) as ``temp`` says, then ``run()`` loads every shard into ``dest``."""

    def __init__(self, spec: VersionSpec, store: list[Path], dest: dict[str, torch.Tensor],
                 settings: Settings, device: str) -> None:  # fmt: skip
        self.spec, self.store, self.dest, self.device = spec, store, dest, device
        self.loader = WeightLoader(settings)
        manifest = spec.manifest
        assert manifest is not None
        self.entries = [self.loader.cache.weights_path(CacheKey(
            SHARDED_MODEL, SHARDED_VERSION, f.sha256, manifest=manifest.digest))
            for f in manifest.shards]  # fmt: skip
        self.outcomes: dict[str, list[str]] = {}

    # Ember: cold = a miss from the store, warm = a hit; "ember-nvme": a hit, pages dropped.
    def prepare_ember(self, temp: str) -> None:
        if temp == "cold":
            self.loader.cache.evict(SHARDED_MODEL, SHARDED_VERSION)
            for path in self.store:
                make_cold(path)
        else:
            self._entries_warm()

    def prepare_ember_nvme(self, temp: str) -> None:
        if temp == "cold":
            if not all(p.exists() for p in self.entries):
                self.loader.warm_version(self.spec)
            for path in self.entries:
                make_cold(path)
        else:
            self._entries_warm()

    def _entries_warm(self) -> None:
        if not all(p.exists() for p in self.entries):
            self.loader.warm_version(self.spec)
        for path in self.entries:
            make_warm(path)

    def ember(self, name: str) -> None:
        loaded = self.loader.load_version(self.spec, device=self.device, into=self.dest)
        if loaded.pin is not None:
            loaded.pin.release()
        self.outcomes.setdefault(name, []).append(loaded.report.cache)

    # The peers read the store's shards: cold = dropped, warm = resident.
    def prepare_store(self, temp: str) -> None:
        for path in self.store:
            (make_cold if temp == "cold" else make_warm)(path)

    def safetensors(self) -> None:
        from safetensors.torch import load_file as st_load

        for path in self.store:
            for name, t in st_load(str(path), device="cpu").items():
                _copy_into(self.dest, name, t)

    def runai(self) -> None:
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as s:
            # owned=False: views into its reused buffers, each copied out before the next
            s.stream_files([str(p) for p in self.store], device="cpu", owned=False)
            for name, t in s.get_tensors():
                _copy_into(self.dest, name, t)

    def plan(self, peers: str) -> dict[str, tuple[Callable[[str], None], Callable[[], None]]]:
        """name -> (prepare, run), in the order each run measures them."""
        out: dict[str, tuple[Callable[[str], None], Callable[[], None]]] = {
            "ember": (self.prepare_ember, lambda: self.ember("ember")),
            "ember-nvme-hit": (self.prepare_ember_nvme, lambda: self.ember("ember-nvme-hit")),
        }
        wanted = None if peers == "all" else set(peers.split(",")) - {"none"}
        if wanted is None or "safetensors" in wanted:
            out["safetensors"] = (self.prepare_store, self.safetensors)
        try:
            import runai_model_streamer  # noqa: F401

            if wanted is None or "runai" in wanted:
                out["runai"] = (self.prepare_store, self.runai)
        except ImportError:
            print("# runai-model-streamer not installed: skipped", file=sys.stderr)
        return out


def sharded_case(args: argparse.Namespace, work: Path, settings: Settings) -> dict[str, Any]:
    """The checkpoint in shards: Ember (miss / NVMe hit / warm hit), safetensors and Run:ai
    to the device, cold and warm, interleaved; the ``sharded_*`` keys of the JSON line."""
    folder = settings.data_dir / "objects" / f"sharded-{args.size_gib:g}g-{args.shards}"
    if not folder.exists():
        print(f"# writing {folder} ...", file=sys.stderr)
        make_sharded(folder, args.size_gib, args.shards)
    spec = sharded_spec(folder, work / f"{folder.name}.manifest.json")
    manifest = spec.manifest
    assert manifest is not None
    store = [folder / f.path for f in manifest.shards]
    from ember.loader.device import torch_dtypes
    from ember.loader.load import read_header

    dt, dest = torch_dtypes(), {}
    for path in store:
        for t in read_header(path, settings.artifact_max_header_bytes).tensors:
            dest[t.name] = torch.ones(t.shape, dtype=dt[t.dtype], device=args.device)
    data_bytes = sum(t.nbytes for t in dest.values())
    size = sum(p.stat().st_size for p in store)
    print(f"# {folder.name}: {len(store)} shards, {size / GB:.2f} GB, {len(dest)} tensors, "
          f"{settings.loader_shards_in_flight} shards in flight, to {args.device}",
          file=sys.stderr)  # fmt: skip
    loads = ShardedLoads(spec, store, dest, settings, args.device)
    plan, sync = loads.plan(args.peers), on_device(args.device)
    memcpy(1 << 30)
    results: Samples = {}
    limits: dict[str, list[tuple[float, float]]] = {"disk O_DIRECT": [], "page cache": [],
                                                    "memcpy": [], "sha256": [],
                                                    "write": []}  # fmt: skip
    for run in range(args.runs):
        for temp in ("cold", "warm"):
            for name, (prepare, load) in plan.items():
                if name == "ember-nvme-hit" and temp == "warm":
                    continue  # the same load as ember's warm one
                prepare(temp)
                gc.collect()

                def once(load: Callable[[], None] = load) -> None:
                    load()
                    sync()

                results.setdefault((name, temp), []).append(measure(once))
        for path in store:
            make_cold(path)
        limits["disk O_DIRECT"].append(measure(lambda: read_direct_all(store)))
        for path in store:
            make_warm(path)
        limits["page cache"].append(measure(lambda: all(map(buffered_read, store))))
        limits["memcpy"].append(measure(lambda: memcpy(1 << 30)))
        limits["sha256"].append(measure(sha256_once))
        limits["write"].append(measure(lambda: write_fsync(settings.weight_cache_dir)))
        print(f"# sharded run {run + 1}/{args.runs} done", file=sys.stderr)
    expected = {"ember": ["miss", "hit"], "ember-nvme-hit": ["hit"]}
    for name, want in expected.items():
        got = sorted(set(loads.outcomes.get(name, [])))
        if got and got != sorted(want):  # a bench that measured something else says so
            raise RuntimeError(f"{name}: cache outcomes {got}, expected {want}")
    return sharded_summary(results, limits, data_bytes, size, len(store), len(dest), settings,
                           args.runs)  # fmt: skip


def sharded_summary(
    results: Samples,
    limits: dict[str, list[tuple[float, float]]],
    data_bytes: int,
    size: int,
    shards: int,
    tensors: int,
    settings: Settings,
    runs: int,
) -> dict[str, Any]:
    def gbps(samples: list[tuple[float, float]], nbytes: int) -> float:
        return nbytes / statistics.median(s[0] for s in samples) / GB

    def cpu_per_gb(samples: list[tuple[float, float]]) -> float:
        return statistics.median(s[1] for s in samples) / (data_bytes / GB)

    fig: dict[str, dict[str, float]] = {}
    print(f"\nsharded ({shards} shards)  {'cold GB/s':>10} {'warm GB/s':>10} "
          f"{'CPU-s/GB cold':>14} {'CPU-s/GB warm':>14}")  # fmt: skip
    for name in dict.fromkeys(n for n, _ in results):
        row = {}
        for temp in ("cold", "warm"):
            if (name, temp) in results:
                row[temp] = gbps(results[(name, temp)], data_bytes)
                row[f"cpu_{temp}"] = cpu_per_gb(results[(name, temp)])
        fig[name] = row
        cells = [f"{row[k]:10.2f}" if k in row else f"{'-':>10}" for k in ("cold", "warm")]
        cells += [f"{row[k]:14.3f}" if k in row else f"{'-':>14}" for k in ("cpu_cold", "cpu_warm")]
        print(f"{name:20} {' '.join(cells)}")
    lim = {"disk_odirect": gbps(limits["disk O_DIRECT"], size),
           "page_cache": gbps(limits["page cache"], size),
           "memcpy": gbps(limits["memcpy"], 1 << 30),
           "sha256_1thread": gbps(limits["sha256"], SHA256_BYTES),
           "write_fsync": gbps(limits["write"], WRITE_BYTES)}  # fmt: skip
    print(f"sharded limits: disk O_DIRECT (all shards) {lim['disk_odirect']:.2f}, page-cache "
          f"read {lim['page_cache']:.2f}, memcpy {lim['memcpy']:.2f}, sha256 (one thread: a "
          f"miss verifies every byte) {lim['sha256_1thread']:.2f}, buffered write + fsync "
          f"(a miss writes the cache file) {lim['write_fsync']:.2f} GB/s")  # fmt: skip
    peers = [n for n in fig if not n.startswith("ember")]

    def best(temp: str) -> float:
        return max((fig[n][temp] for n in peers), default=float("nan"))

    ember, nvme = fig["ember"], fig["ember-nvme-hit"]
    return {
        "sharded_ember_vs_best_peer_cold": ember["cold"] / best("cold"),
        "sharded_ember_vs_best_peer_warm": ember["warm"] / best("warm"),
        "sharded_ember_vs_limit_cold": ember["cold"] / lim["disk_odirect"],
        "sharded_ember_vs_limit_warm": ember["warm"] / lim["memcpy"],
        "sharded_ember_nvme_hit_vs_best_peer_cold": nvme["cold"] / best("cold"),
        "sharded_ember_nvme_hit_vs_limit_cold": nvme["cold"] / lim["disk_odirect"],
        "sharded_ember_cold_gbps": ember["cold"],
        "sharded_ember_warm_gbps": ember["warm"],
        "sharded_ember_nvme_hit_gbps": nvme["cold"],
        "sharded_ember_cpu_s_per_gb": ember["cpu_cold"],
        "sharded_limits_gbps": {k: round(v, 3) for k, v in lim.items()},
        "sharded_shards": shards,
        "sharded_bytes": size,
        "sharded_tensors": tensors,
        "sharded_shards_in_flight": settings.loader_shards_in_flight,
        "sharded_runs": runs,
        "sharded_loaders": {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in fig.items()},
    }


def s3_figures(work: Path, settings: Settings, device: str = "cpu") -> dict[str, float]:
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
        miss = loader.load("bench", "1", uri, sha, device=device)
        assert miss.report.cache == "miss"
        entry = loader.cache.weights_path(miss.pin.key)  # type: ignore[union-attr]
        make_cold(entry)
        hit_cold = loader.load("bench", "1", uri, sha, device=device)
        make_warm(entry)
        hit_warm = loader.load("bench", "1", uri, sha, device=device)
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
