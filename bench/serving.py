"""Gateway overhead: the example model through the full online path vs the replica directly.

Starts a real `ember serve` (pools controller on, one hot replica of the MLP example),
then sends the same open-loop Poisson load at a fixed rate to
``POST /v1/models/mlp:predict`` (auth, admission, routing, forwarding) and straight to
the replica's ``POST /infer``, interleaved, and prints p50/p99 of both and the difference.
Last line: one JSON object with ``gateway_p50_added_ms``, ``gateway_p99_added_ms``.

    python bench/serving.py [--rate 20] [--seconds 15] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ember.engine.examples.mlp import ENGINE_CONFIG, INPUT_SCHEMA, build_mlp_artifact  # noqa: E402
from tests.services import free_port, wait_until  # noqa: E402

KEY = "ek_bench-serving-admin-key-0123456789"
X = [0.01 * i for i in range(256)]


async def open_loop(
    url: str, headers: dict[str, str], rate: float, seconds: float, seed: int
) -> list[float]:
    rng = random.Random(seed)
    latencies: list[float] = []
    async with httpx.AsyncClient(headers=headers, timeout=30) as client:

        async def one() -> None:
            started = time.perf_counter()
            r = await client.post(url, json={"instances": [X]})
            r.raise_for_status()
            latencies.append((time.perf_counter() - started) * 1000)

        tasks = []
        began = at = time.perf_counter()
        while at < began + seconds:
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=20)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="ember-bench-serving-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env |= {
        "EMBER_DATA_DIR": str(data),
        "EMBER_PORT": str(port),
        "EMBER_ADMIN_KEY": KEY,
        "EMBER_STANDBY_REPLICAS": "0",
        "EMBER_LOG_LEVEL": "WARNING",
    }
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("ember")), "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        wait_until(lambda: httpx.get(f"{api}/healthz").status_code == 200, 60, "ember serve")
        path = build_mlp_artifact(data / "objects" / "mlp" / "1" / "model.safetensors")
        c = httpx.Client(base_url=api, headers=headers, timeout=60)
        c.post("/v1/models", json={"name": "mlp"}).raise_for_status()
        c.post(
            "/v1/models/mlp/versions",
            json={
                "version": "1",
                "artifact_uri": path.as_uri(),
                "engine": "torch",
                "engine_config": ENGINE_CONFIG,
                "input_schema": INPUT_SCHEMA,
            },
        ).raise_for_status()
        c.post(
            "/v1/deployments", json={"model": "mlp", "version": "1", "max_batch_size": 8}
        ).raise_for_status()

        def ready() -> list[dict[str, object]]:
            reps = c.get("/v1/deployments/mlp/replicas").json()["replicas"]
            return [r for r in reps if r["state"] == "ready"]

        wait_until(lambda: bool(ready()), 180, "a ready replica")
        replica = str(ready()[0]["url"])
        gateway_url, direct_url = f"{api}/v1/models/mlp:predict", f"{replica}/infer"
        asyncio.run(open_loop(gateway_url, headers, args.rate, 3, 0))  # warm-up both paths
        asyncio.run(open_loop(direct_url, {}, args.rate, 3, 0))
        results: dict[str, list[float]] = {"gateway": [], "direct": []}
        for rnd in range(args.rounds):  # interleaved rounds, same seeds for both paths
            for name, url, hdrs in (("direct", direct_url, {}), ("gateway", gateway_url, headers)):
                results[name] += asyncio.run(open_loop(url, hdrs, args.rate, args.seconds, rnd))
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(data, ignore_errors=True)
    g, d = results["gateway"], results["direct"]
    print(
        f"MLP example, one hot replica, open loop at {args.rate:g} req/s, "
        f"{args.rounds} x {args.seconds:g} s per path, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'path':<10} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name, lat in (("direct", d), ("gateway", g)):
        p50, p99, mean = pct(lat, 0.5), pct(lat, 0.99), statistics.mean(lat)
        print(f"{name:<10} {len(lat):>6} {p50:>8.2f} {p99:>8.2f} {mean:>8.2f}")
    added50, added99 = pct(g, 0.5) - pct(d, 0.5), pct(g, 0.99) - pct(d, 0.99)
    print(f"gateway adds {added50:.2f} ms at p50, {added99:.2f} ms at p99 (target: <= 1 ms at p50)")
    print(
        json.dumps(
            {
                "gateway_p50_added_ms": round(added50, 3),
                "gateway_p99_added_ms": round(added99, 3),
                "direct_p50_ms": round(pct(d, 0.5), 3),
                "gateway_p50_ms": round(pct(g, 0.5), 3),
                "target_met": added50 <= 1.0,
            }
        )
    )


if __name__ == "__main__":
    main()
