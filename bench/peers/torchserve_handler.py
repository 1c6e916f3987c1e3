"""TorchServe handler for MiniLM: the request body is the sentence (text/plain); TorchServe
batches requests (``batchSize`` / ``maxBatchDelay``) and this returns one vector each."""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from minilm import MiniLM

_model: MiniLM | None = None


def _text(request: dict[str, Any]) -> str:
    value = request.get("body") if request.get("body") is not None else request.get("data")
    if isinstance(value, bytes | bytearray):
        return value.decode()
    return str(value)


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[Any] | None:
    global _model
    if _model is None:
        _model = MiniLM()
    if data is None:  # the load-time call
        return None
    return _model.embed([_text(r) for r in data])
