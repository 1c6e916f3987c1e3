"""KServe's Python model server (no in-process batching) serving MiniLM on V1
(``POST /v1/models/minilm:predict {"instances": [...]}``) and V2 (``POST
/v2/models/minilm/infer``, a ``BYTES`` input). HTTP only, bound to 127.0.0.1.

    python kserve_server.py --port 8001
"""

from __future__ import annotations

import argparse
import logging
import sys
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import uvicorn
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer
from minilm import MiniLM as Embedder


class MiniLM(Model):
    def __init__(self) -> None:
        super().__init__("minilm")
        self.model: Embedder | None = None

    def load(self) -> bool:
        self.model = Embedder()
        self.ready = True
        return True

    def predict(self, payload: Any, headers: dict[str, str] | None = None) -> Any:
        assert self.model is not None
        if isinstance(payload, InferRequest):
            texts = [t.decode() if isinstance(t, bytes) else str(t) for t in payload.inputs[0].data]
            vectors = self.model.embed(texts)
            out = InferOutput(name="embedding", shape=[len(vectors), 384], datatype="FP32")
            out.data = [x for v in vectors for x in v]
            return InferResponse(
                response_id=payload.id or str(uuid.uuid4()),
                model_name=self.name,
                infer_outputs=[out],
            )
        return {"predictions": self.model.embed([str(t) for t in payload["instances"]])}


class LoopbackConfig(uvicorn.Config):
    """KServe hard-codes host 0.0.0.0 in its uvicorn config: keep it on loopback."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["host"] = "127.0.0.1"
        super().__init__(*args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.Config = LoopbackConfig  # type: ignore[misc]
    model = MiniLM()
    model.load()
    server = ModelServer(
        http_port=args.port, enable_grpc=False, workers=1, enable_latency_logging=False
    )
    # As quiet as the other servers: no access or per-request log lines.
    for name in ("uvicorn.access", "kserve", "kserve.trace"):
        logging.getLogger(name).setLevel(logging.WARNING)
    server.start([model])


if __name__ == "__main__":
    main()
