"""The async queue: jobs/s through Celery + Redis at a given worker count, and the latency
a job adds over calling the same model online.

One ``ember serve`` (pools on, one hot replica of the MLP example, batching 32 / 5 ms),
a private Redis, and ``ember worker`` processes (``--workers``, each with
``--concurrency`` threads). For each worker count:

- **online**: sequential ``POST /v1/models/mlp:predict`` calls (one instance each):
  p50/p95 latency, calls/s;
- **job latency**: ``--latency-jobs`` jobs of one instance, one at a time on an idle
  queue: ``finished_at - created_at`` (accepted → result written), and what the client
  saw (submit → polled finished, every 10 ms);
- **added latency** = job latency - online latency: what the queue, the worker's claim,
  the gateway hop and the fenced result write add to one call;
- **jobs/s**: a burst of ``--jobs`` one-instance jobs submitted at once (8 client
  threads); jobs / (last result written - first submit).

Side by side in one table; last line one JSON object with the figures.

    python bench/jobs.py [--workers 1 --workers 2] [--concurrency 4] [--jobs 200]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.services import free_port, wait_until  # noqa: E402

KEY = "ek_bench-jobs-admin-key-0123456789"
EMBER = str(Path(sys.executable).with_name("ember"))
X = [0.5] * 256


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    import redis

    wait_until(lambda: bool(redis.Redis.from_url(url).ping()), 15, "redis")
    return proc, url


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def online_round(client: httpx.Client, calls: int) -> list[float]:
    latencies = []
    for _ in range(calls):
        t0 = time.perf_counter()
        response = client.post("/v1/models/mlp:predict", json={"instances": [X]})
        latencies.append(time.perf_counter() - t0)
        response.raise_for_status()
    return latencies


def _ts(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def submit(client: httpx.Client) -> str:
    response = client.post("/v1/jobs", json={"model": "mlp", "inputs": {"instances": [X]}})
    if response.status_code != 202:
        raise RuntimeError(f"submit failed: {response.status_code} {response.text[:300]}")
    return str(response.json()["id"])


def sequential_round(client: httpx.Client, jobs: int) -> dict[str, list[float]]:
    """One job at a time on an idle queue: what the async path adds to one call.
    ``server``: created_at -> finished_at (accepted -> result written); ``client``: the
    submit request -> the job seen finished (polled every 10 ms)."""
    server, seen = [], []
    for _ in range(jobs):
        t0 = time.perf_counter()
        job_id = submit(client)
        while True:
            job = client.get(f"/v1/jobs/{job_id}").json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.01)
        seen.append(time.perf_counter() - t0)
        if job["status"] != "succeeded":
            raise RuntimeError(f"job {job_id} {job['status']}: {job['error']}")
        server.append(_ts(job["finished_at"]) - _ts(job["created_at"]))
    return {"server": server, "client": seen}


def burst_round(client: httpx.Client, jobs: int) -> dict[str, Any]:
    """``jobs`` submitted at once: jobs/s through the queue (first submit -> last result)."""
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: submit(client), range(jobs)))
    pending, done = set(ids), {}
    deadline = time.monotonic() + 600
    while pending and time.monotonic() < deadline:
        time.sleep(1.0)
        for job_id in list(pending):
            job = client.get(f"/v1/jobs/{job_id}").json()
            if job["status"] not in ("succeeded", "failed", "cancelled"):
                break  # oldest first: the rest are not done either
            done[job_id] = job
            pending.discard(job_id)
    finished = [_ts(j["finished_at"]) for j in done.values()]
    wall = max(finished) - started if finished else float("nan")
    return {
        "burst_latency": [_ts(j["finished_at"]) - _ts(j["created_at"]) for j in done.values()],
        "failed": sum(j["status"] != "succeeded" for j in done.values()),
        "lost": len(pending),
        "jobs_per_s": len(done) / wall if wall > 0 else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, action="append", help="Worker processes.")
    parser.add_argument("--concurrency", type=int, default=4, help="Threads per worker.")
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--online-calls", type=int, default=100)
    parser.add_argument("--latency-jobs", type=int, default=40, help="Sequential jobs.")
    args = parser.parse_args()
    counts = args.workers or [1, 2]

    tmp = Path(tempfile.mkdtemp(prefix="ember-bench-jobs-"))
    redis_proc, redis_url = start_redis(tmp)
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env = base | {
        "EMBER_DATA_DIR": str(tmp / "data"),
        "EMBER_ADMIN_KEY": KEY,
        "EMBER_PORT": str(port),
        "EMBER_REDIS_URL": redis_url,
        "EMBER_STANDBY_REPLICAS": "0",
        "EMBER_LOG_LEVEL": "WARNING",
        "EMBER_JOBS_API_KEY": KEY,
        "EMBER_JOBS_WORKER_CONCURRENCY": str(args.concurrency),
    }
    api = spawn([EMBER, "serve"], env, tmp / "api.log")
    procs = [api]
    url = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    try:
        wait_until(lambda: httpx.get(f"{url}/healthz").status_code == 200, 60, "ember serve")
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        from ember.engine.examples.mlp import ENGINE_CONFIG, INPUT_SCHEMA, build_mlp_artifact

        artifact = build_mlp_artifact(tmp / "data" / "objects" / "mlp" / "model.safetensors")
        client.post("/v1/models", json={"name": "mlp"}).raise_for_status()
        client.post(
            "/v1/models/mlp/versions",
            json={
                "version": "1",
                "artifact_uri": artifact.as_uri(),
                "engine": "torch",
                "engine_config": ENGINE_CONFIG,
                "input_schema": INPUT_SCHEMA,
            },
        ).raise_for_status()
        client.post(
            "/v1/deployments",
            json={"model": "mlp", "version": "1", "max_replicas": 1, "max_batch_size": 32},
        ).raise_for_status()

        def ready() -> bool:
            replicas = client.get("/v1/deployments/mlp/replicas").json()["replicas"]
            return any(r["state"] == "ready" for r in replicas)

        wait_until(ready, 180, "the mlp replica")
        online_round(client, 10)  # warm-up
        for count in counts:
            workers = [  # INFO: the worker logs "ready" when it consumes
                spawn(
                    [EMBER, "worker"],
                    env | {"EMBER_LOG_LEVEL": "INFO"},
                    tmp / f"worker-{count}-{i}.log",
                )
                for i in range(count)
            ]
            procs += workers
            for i in range(count):
                log = tmp / f"worker-{count}-{i}.log"
                wait_until(lambda log=log: b"ready" in log.read_bytes(), 60, "a worker")
            sequential_round(client, 3)  # warm-up
            online = online_round(client, args.online_calls)
            latency = sequential_round(client, args.latency_jobs)
            result = burst_round(client, args.jobs)
            stop(workers)
            rows.append({"workers": count, "online": online, **latency, **result})
    finally:
        stop(procs)
        redis_proc.terminate()
        redis_proc.wait(10)

    print(
        f"\nAsync queue vs online, MLP example (1 instance per call), 1 replica, "
        f"{args.concurrency} threads/worker"
    )
    header = (
        f"{'workers':>7} | {'online p50 ms':>13} | {'job p50 ms':>10} | "
        f"{'added p50 ms':>12} | {'added p95 ms':>12} | {'seen p50 ms':>11} | "
        f"{'online calls/s':>14} | {'jobs/s (burst)':>14} | {'burst p95 s':>11} | failed/lost"
    )
    print(header)
    print("-" * len(header))
    summary: dict[str, Any] = {"concurrency": args.concurrency, "jobs": args.jobs}
    for row in rows:
        o50, o95 = pct(row["online"], 0.5) * 1000, pct(row["online"], 0.95) * 1000
        j50, j95 = pct(row["server"], 0.5) * 1000, pct(row["server"], 0.95) * 1000
        c50 = pct(row["client"], 0.5) * 1000
        b95 = pct(row["burst_latency"], 0.95) if row["burst_latency"] else float("nan")
        ops = len(row["online"]) / sum(row["online"])
        print(
            f"{row['workers']:>7} | {o50:>13.1f} | {j50:>10.1f} | {j50 - o50:>12.1f} | "
            f"{j95 - o95:>12.1f} | {c50:>11.1f} | {ops:>14.1f} | {row['jobs_per_s']:>14.1f} | "
            f"{b95:>11.1f} | {row['failed']}/{row['lost']}"
        )
        key = f"w{row['workers']}"
        summary |= {
            f"{key}_jobs_per_s": round(row["jobs_per_s"], 2),
            f"{key}_online_calls_per_s": round(ops, 2),
            f"{key}_online_p50_ms": round(o50, 2),
            f"{key}_job_p50_ms": round(j50, 2),
            f"{key}_job_p95_ms": round(j95, 2),
            f"{key}_added_latency_p50_ms": round(j50 - o50, 2),
            f"{key}_added_latency_p95_ms": round(j95 - o95, 2),
            f"{key}_client_seen_p50_ms": round(c50, 2),
            f"{key}_burst_p95_s": round(b95, 2),
            f"{key}_failed": row["failed"],
            f"{key}_lost": row["lost"],
        }
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
