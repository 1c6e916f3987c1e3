"""BentoML 1.4 service for MiniLM with adaptive batching:
``POST /embed {"texts": ["..."]}`` → ``[[...]]``.

    bentoml serve bentoml_service:MiniLM --host 127.0.0.1 --port 8001
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bentoml
from minilm import MiniLM as Model

MAX_BATCH = int(os.environ.get("BENTO_MAX_BATCH", "16"))


@bentoml.service(workers=1, traffic={"timeout": 60}, logging={"access": {"enabled": False}})
class MiniLM:
    def __init__(self) -> None:
        self.model = Model()

    # BentoML has no fixed queue delay: max_latency_ms is the latency budget its adaptive
    # dispatcher works within (generous here so that it never sheds).
    @bentoml.api(batchable=True, max_batch_size=MAX_BATCH, max_latency_ms=10_000)
    def embed(self, texts: list[str]) -> list[list[float]]:
        return self.model.embed(texts)
