"""PyTriton (Triton Inference Server, Python backend) serving MiniLM with Triton's dynamic
batcher: ``POST /v2/models/minilm/infer`` with a ``BYTES`` input ``text`` of shape [1, 1].

    python pytriton_server.py --port 8001 --grpc-port 8002 --metrics-port 8003
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from minilm import MiniLM
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--grpc-port", type=int, required=True)
    ap.add_argument("--metrics-port", type=int, required=True)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--delay-ms", type=float, default=10)
    args = ap.parse_args()
    model = MiniLM()

    @batch
    def infer(text: np.ndarray) -> dict[str, np.ndarray]:
        sentences = [row[0].decode() if isinstance(row[0], bytes) else str(row[0]) for row in text]
        return {"embedding": model.vectors(sentences).numpy().astype(np.float32)}

    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=args.port,
        grpc_address="127.0.0.1",
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        allow_metrics=False,
        log_verbose=0,
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name="minilm",
            infer_func=infer,
            inputs=[Tensor(name="text", dtype=bytes, shape=(1,))],
            outputs=[Tensor(name="embedding", dtype=np.float32, shape=(384,))],
            config=ModelConfig(
                max_batch_size=args.max_batch,
                batcher=DynamicBatcher(max_queue_delay_microseconds=int(args.delay_ms * 1000)),
            ),
            strict=False,
        )
        triton.serve()


if __name__ == "__main__":
    main()
