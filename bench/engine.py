"""Dynamic batching, measured: one real `ember engine` replica, batching off vs on.

The tensor example model (an MLP, hidden 4096: weight-memory-bound at batch 1, like most
served models) behind a real replica process pinned to one CPU; the load generator on
the other. Two measurements per mode: an open-loop Poisson arrival rate both modes can
sustain (latency: p50, p99) and a closed loop of concurrent clients (max throughput).
Prints a table, then one JSON line:
``batched_vs_unbatched_throughput``, ``batched_p99_vs_unbatched_p99``.

    python bench/engine.py [--seconds 20] [--concurrency 64]

Needs ``wrk`` (Debian package; ``make bench-engine`` installs it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ember.engine.examples.mlp import build_mlp_artifact  # noqa: E402
from tests.services import free_port, wait_until  # noqa: E402

KWARGS = {"in_features": 256, "hidden": 4096, "out_features": 16, "layers": 3}
X = [0.01 * i for i in range(256)]


def start_replica(workdir: Path, batch: bool) -> tuple[subprocess.Popen[bytes], str]:
    path = workdir / "objects" / "mlp" / "1" / "model.safetensors"
    if not path.exists():
        build_mlp_artifact(path, **KWARGS)
    spec = {
        "model": "mlp",
        "version": "1",
        "artifact_uri": path.as_uri(),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "engine": "torch",
        "engine_config": {"factory": "ember.engine.examples.mlp:mlp", "kwargs": KWARGS},
        "input_schema": {"shape": [256], "dtype": "float32"},
    }
    (workdir / "spec.json").write_text(json.dumps(spec))
    port = free_port()
    cmd = [
        str(Path(sys.executable).with_name("ember")),
        "engine",
        "--port",
        str(port),
        "--spec-file",
        str(workdir / "spec.json"),
        "--threads",
        "1",
        "--max-queue",
        "4096",
        "--max-batch-size",
        "64" if batch else "1",
        "--max-queue-delay-ms",
        "2" if batch else "0",
    ]
    if shutil.which("taskset") and len(os.sched_getaffinity(0)) > 1:
        cmd = ["taskset", "-c", "1", *cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env |= {"EMBER_DATA_DIR": str(workdir), "EMBER_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/readyz").status_code == 200, 120, "replica")
    return proc, url


WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[%s]==]
done = function(summary, latency, requests)
  io.write(string.format("RESULT %%d %%f %%f %%f\\n", summary.requests, summary.duration / 1e6,
    latency:percentile(50) / 1e3, latency:percentile(99) / 1e3))
  io.write(string.format("ERRORS %%d\\n", summary.errors.status + summary.errors.connect
    + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
"""


def wrk_closed_loop(url: str, connections: int, seconds: float, workdir: Path) -> dict[str, float]:
    """Max throughput with wrk (C, one thread on the load generator's CPU): a Python
    client tops out far below a batching replica (httpx's pool collapses at 64
    connections), so it would measure itself."""
    script = workdir / "infer.lua"
    script.write_text(WRK_SCRIPT % json.dumps({"instances": [X]}))
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{int(seconds)}s", "--timeout", "30s",
         "-s", str(script), f"{url}/infer"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    fields = next(line for line in out.splitlines() if line.startswith("RESULT")).split()
    errors = int(next(line for line in out.splitlines() if line.startswith("ERRORS")).split()[1])
    n, duration = int(fields[1]), float(fields[2])
    return {"max_rps": n / duration, "max_p50_ms": float(fields[3]),
            "max_p99_ms": float(fields[4]), "max_errors": errors}  # fmt: skip


async def closed_loop(url: str, concurrency: int, seconds: float) -> tuple[float, list[float]]:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:

        async def worker() -> None:
            while time.perf_counter() < stop:
                started = time.perf_counter()
                r = await client.post("/infer", json={"instances": [X]})
                r.raise_for_status()
                latencies.append(time.perf_counter() - started)

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
    return len(latencies) / elapsed, latencies


async def open_loop(
    url: str, rate: float, seconds: float, seed: int = 7
) -> tuple[float, list[float]]:
    rng = random.Random(seed)
    latencies: list[float] = []
    errors = 0
    async with httpx.AsyncClient(
        base_url=url, timeout=60, limits=httpx.Limits(max_connections=512)
    ) as client:

        async def one() -> None:
            nonlocal errors
            started = time.perf_counter()
            r = await client.post("/infer", json={"instances": [X]})
            if r.status_code == 200:
                latencies.append(time.perf_counter() - started)
            else:
                errors += 1

        tasks = []
        began = time.perf_counter()
        at = began
        while at < began + seconds:
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    if errors:
        print(f"  ({errors} errors at {rate:.0f} req/s)")
    return len(latencies) / seconds, latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--concurrency", type=int, default=64, help="wrk connections")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {0})  # the load generator stays off the replica's CPU
    workdir = Path(tempfile.mkdtemp(prefix="ember-bench-engine-"))
    results: dict[str, dict[str, float]] = {}
    try:
        for mode in ("unbatched", "batched"):
            proc, url = start_replica(workdir, batch=mode == "batched")
            try:
                asyncio.run(closed_loop(url, 8, 3))  # warm-up
                results[mode] = wrk_closed_loop(url, args.concurrency, args.seconds, workdir)
            finally:
                proc.terminate()
                proc.wait(30)
        rate = 0.7 * results["unbatched"]["max_rps"]  # a rate both modes can sustain
        for mode in ("unbatched", "batched"):
            proc, url = start_replica(workdir, batch=mode == "batched")
            try:
                asyncio.run(closed_loop(url, 8, 3))
                got, lat = asyncio.run(open_loop(url, rate, args.seconds))
                results[mode] |= {"rate": got, "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99)}
            finally:
                proc.terminate()
                proc.wait(30)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    u, b = results["unbatched"], results["batched"]
    print(f"MLP {KWARGS}, replica on 1 CPU (1 torch thread), {args.seconds:.0f} s per run")
    print(
        f"{'mode':<10} {'max req/s':>10} {'p50@max':>9} {'p99@max':>9} | "
        f"{'open-loop req/s':>15} {'p50 ms':>8} {'p99 ms':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:<10} {r['max_rps']:>10.1f} {r['max_p50_ms']:>9.1f} {r['max_p99_ms']:>9.1f} | "
            f"{r['rate']:>15.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f}"
        )
    print(
        f"batched / unbatched: throughput x{b['max_rps'] / u['max_rps']:.2f}, "
        f"p99 at {rate:.0f} req/s x{b['p99_ms'] / u['p99_ms']:.2f}"
    )
    print(
        json.dumps(
            {
                "batched_vs_unbatched_throughput": round(b["max_rps"] / u["max_rps"], 3),
                "batched_p99_vs_unbatched_p99": round(b["p99_ms"] / u["p99_ms"], 3),
                "unbatched_max_rps": round(u["max_rps"], 1),
                "batched_max_rps": round(b["max_rps"], 1),
                "open_loop_rate_rps": round(rate, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
