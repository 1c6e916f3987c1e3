"""Bare FastAPI + uvicorn serving MiniLM: ``POST /embed {"text": "..."}`` → ``{"embedding": ...}``.

Without ``--batch``: a plain sync endpoint (FastAPI runs it in its thread pool), one forward
pass per request — the floor every serving framework is compared against. With
``--batch N``: a minimal greedy asyncio batcher (one compute thread, up to N per forward
pass) — a reference for what a small Python batcher reaches, not one of the peers.

    python fastapi_server.py --port 8001 [--batch 16]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import uvicorn
from fastapi import FastAPI
from minilm import MiniLM
from pydantic import BaseModel


class EmbedRequest(BaseModel):
    text: str


class Batcher:
    """Greedy: one compute thread; the next batch is whatever queued meanwhile (up to
    ``max_batch``), so a lone request never waits and a loaded server batches."""

    def __init__(self, model: MiniLM, max_batch: int) -> None:
        self.model, self.max_batch = model, max_batch
        self.queue: list[tuple[str, asyncio.Future[list[float]]]] = []
        self.wakeup = asyncio.Event()
        self.pool = ThreadPoolExecutor(1)

    async def submit(self, text: str) -> list[float]:
        future: asyncio.Future[list[float]] = asyncio.get_running_loop().create_future()
        self.queue.append((text, future))
        self.wakeup.set()
        return await future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.wakeup.clear()
                await self.wakeup.wait()
            batch, self.queue = self.queue[: self.max_batch], self.queue[self.max_batch :]
            try:
                out = await loop.run_in_executor(self.pool, self.model.embed, [t for t, _ in batch])
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
            else:
                for (_, future), vector in zip(batch, out, strict=True):
                    if not future.done():
                        future.set_result(vector)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--batch", type=int, default=0)
    args = ap.parse_args()
    model = MiniLM()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if args.batch:
            state["batcher"] = batcher = Batcher(model, args.batch)
            state["task"] = asyncio.create_task(batcher.run())
        yield

    app = FastAPI(lifespan=lifespan)
    if args.batch:

        @app.post("/embed")
        async def embed_batched(body: EmbedRequest) -> dict[str, Any]:
            return {"embedding": await state["batcher"].submit(body.text)}
    else:

        @app.post("/embed")
        def embed(body: EmbedRequest) -> dict[str, Any]:
            return {"embedding": model.embed([body.text])[0]}

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
