"""Ray Serve serving MiniLM with ``@serve.batch``: ``POST / {"text": "..."}`` →
``{"embedding": [...]}``. One replica; ``max_ongoing_requests`` raised so that the batch
can fill (Ray's default of 5 would cap it at 5).

    python ray_server.py --port 8001 --temp-dir /tmp/rb-x
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = str(Path(__file__).resolve().parent)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--temp-dir", required=True)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--delay-ms", type=float, default=10)
    args = ap.parse_args()

    import ray
    from ray import serve
    from starlette.requests import Request

    ray.init(
        num_cpus=2,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        _temp_dir=args.temp_dir,
        runtime_env={"env_vars": {k: os.environ[k] for k in ("MINILM_DIR", "OMP_NUM_THREADS")}},
    )
    quiet = {"enable_access_log": False, "log_level": "WARNING"}
    serve.start(http_options={"host": "127.0.0.1", "port": args.port}, logging_config=quiet)

    @serve.deployment(
        num_replicas=1,
        max_ongoing_requests=64,
        ray_actor_options={"num_cpus": 1},
        logging_config=quiet,
    )
    class MiniLM:
        def __init__(self, here: str) -> None:
            sys.path.insert(0, here)  # replicas do not inherit the launcher's import path
            from minilm import MiniLM as Model

            self.model = Model()

        @serve.batch(max_batch_size=args.max_batch, batch_wait_timeout_s=args.delay_ms / 1000)
        async def embed(self, texts: list[str]) -> list[list[float]]:
            # Off the replica's event loop: a blocking forward pass starves the proxy's
            # queue-length probes (it then backs off for up to a second per request).
            return await asyncio.to_thread(self.model.embed, texts)

        async def __call__(self, request: Request) -> dict[str, Any]:
            body = await request.json()
            return {"embedding": await self.embed(body["text"])}

    serve.run(MiniLM.bind(HERE), route_prefix="/", name="minilm")
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
