"""``transformers`` engine: the architecture from ``config.json`` beside the weights.

engine_config::

    {"task": "embedding", "max_length": 256}        # mean-pooled, L2-normalised vectors
    {"task": "classification", "max_length": 256}   # {"label", "score", "scores"}

No other key; the artifact's own code (an ``auto_map``) is never run
(``trust_remote_code=False``). Sidecar files (config and tokenizer) are fetched from the
artifact's prefix in the object store into a directory keyed by model and version, then
read offline.

Each text is tokenized once, in ``prepare`` (which must count its tokens anyway): with a
``tokenizers`` backend the prepared value is the encoding (truncated to ``max_length`` the
way the tokenizer's own call truncates) and ``forward`` only pads the batch into tensors.
A tokenizer without such a backend is called again in ``forward``, as a whole batch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import ValidationError

from ember.config import Settings
from ember.domain.spec import Tier, TransformersOptions, VersionSpec
from ember.engine import packed
from ember.engine.base import Sized, register_engine
from ember.engine.sidecars import fetch_sidecars
from ember.engine.weights import ModuleEngine, build_and_load
from ember.errors import InvalidInput
from ember.logs import get_logger

if TYPE_CHECKING:
    from tokenizers import Encoding, Tokenizer

log = get_logger(__name__)
TASKS = ("embedding", "classification")


@register_engine("transformers")
class TransformersEngine(ModuleEngine):
    def __init__(self, spec: VersionSpec, settings: Settings, device: str = "cpu") -> None:
        super().__init__(spec, settings, device)
        task = spec.engine_config.get("task", "embedding")
        if task not in TASKS:
            raise InvalidInput(f"transformers task must be one of {TASKS}, got {task!r}")
        try:
            options = TransformersOptions.model_validate(spec.engine_config)
        except ValidationError as exc:
            raise InvalidInput(f"invalid transformers engine_config: {exc}") from exc
        self.task: str = options.task
        self.max_length = options.max_length
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.files = fetch_sidecars(spec, settings)
        from transformers import AutoTokenizer

        # Never the artifact's own code (an ``auto_map`` in its config or tokenizer config).
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.files), trust_remote_code=False)
        self.encoders = self._encoders()
        self.padding_free = False

    def load(self) -> None:
        from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

        config = AutoConfig.from_pretrained(str(self.files), trust_remote_code=False)
        cls = AutoModel if self.task == "embedding" else AutoModelForSequenceClassification
        prefix = f"{getattr(cls, 'base_model_prefix', '') or config.model_type}."
        module, loaded = build_and_load(
            lambda: cls.from_config(config),  # type: ignore[no-untyped-call]
            self.spec,
            self.settings,
            self.device,
            prefix,
        )
        self.adopt(module, loaded)
        self.padding_free = self._padding_free(module)
        log.info(
            "weights loaded",
            seconds=round(loaded.report.seconds, 3),
            cache=str(loaded.report.cache),
            padding_free=self.padding_free,
        )

    def _padding_free(self, module: Any) -> bool:
        """The padding-free forward (``ember.engine.packed``) where it applies: a BERT
        encoder (embeddings) or BERT sequence classifier, right padding, a ``tokenizers``
        backend — and where it agrees with the padded forward on two sentences of
        different lengths."""
        if self.encoders is None or self.tokenizer.padding_side != "right":
            return False
        fits = packed.fits if self.task == "embedding" else packed.fits_classifier
        if not fits(module):
            return False
        truncating = self.encoders[1]
        sample = [truncating.encode(t) for t in ("a b c", "the quick brown fox jumps over it")]
        try:
            got, want = self._packed_answer(module, sample), self._padded_answer(sample)
            gap = float((got - want).abs().max())
        except Exception as exc:  # a structure fits() did not foresee
            log.warning("padding-free forward failed its check; padded", error=str(exc)[:300])
            return False
        if not gap <= packed.AGREE_ATOL:
            log.warning("padding-free forward disagrees with the padded one; padded", gap=gap)
            return False
        return True

    def _packed_answer(self, module: Any, batch: Sequence[Any]) -> torch.Tensor:
        """Embeddings or logits, padding-free."""
        if self.task == "embedding":
            return packed.pooled(module, batch, self.device)
        return packed.logits(module, batch, self.device)

    def _padded_answer(self, batch: Sequence[Any]) -> torch.Tensor:
        """Embeddings or logits, padded."""
        if self.task == "embedding":
            return self._padded_embeddings(batch)
        logits: torch.Tensor = self._padded(batch)[0].logits
        return logits

    def _encoders(self) -> tuple[Tokenizer, Tokenizer] | None:
        """Two private copies of the tokenizer's backend (their truncation settings are
        state): one that counts every token, one that truncates as ``forward`` must."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or self.tokenizer.pad_token_id is None:
            return None
        from tokenizers import Tokenizer

        counting, truncating = (Tokenizer.from_str(backend.to_str()) for _ in range(2))
        counting.no_truncation()
        counting.no_padding()
        truncating.no_padding()
        side = self.tokenizer.truncation_side
        truncating.enable_truncation(self.max_length, strategy="longest_first", direction=side)
        return counting, truncating

    def prepare(self, instance: Any) -> Sized:
        text = instance.get("text") if isinstance(instance, dict) else instance
        if not isinstance(text, str):
            raise InvalidInput('each instance must be a string or {"text": "..."}')
        if self.encoders is None:
            return Sized(text, len(self.tokenizer(text, truncation=False)["input_ids"]))
        counting, truncating = self.encoders
        encoding = counting.encode(text)
        tokens = len(encoding.ids)
        if tokens > self.max_length:
            encoding = truncating.encode(text)
        return Sized(encoding, tokens)

    def _pad(self, batch: Sequence[Encoding]) -> dict[str, torch.Tensor]:
        """The batch's encodings as the tensors ``tokenizer(..., padding=True)`` returns."""
        width = max(len(e.ids) for e in batch)
        shape = (len(batch), width)
        ids = np.full(shape, self.tokenizer.pad_token_id, dtype=np.int64)
        types = np.full(shape, self.tokenizer.pad_token_type_id, dtype=np.int64)
        mask = np.zeros(shape, dtype=np.int64)
        left = self.tokenizer.padding_side == "left"
        for row, e in enumerate(batch):
            cols = slice(width - len(e.ids), width) if left else slice(0, len(e.ids))
            ids[row, cols], types[row, cols], mask[row, cols] = e.ids, e.type_ids, 1
        arrays = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
        names = self.tokenizer.model_input_names
        return {k: torch.from_numpy(v) for k, v in arrays.items() if k in names}

    def forward(self, batch: Sequence[Any]) -> list[Any]:
        if self.module is None or self.tier is not Tier.hot:
            raise InvalidInput(f"replica is {self.tier.value}, not hot")
        answer = (
            self._packed_answer(self.module, batch)  # only with encoders: batch = encodings
            if self.padding_free
            else self._padded_answer(batch)
        )
        if self.task == "embedding":
            return list(answer.cpu().tolist())
        return self._classify(answer)

    def _padded(self, batch: Sequence[Any]) -> Any:
        """The module's output for the batch padded to its longest instance."""
        assert self.module is not None
        if self.encoders is None:
            tensors = self.tokenizer(
                list(batch),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
        else:
            tensors = self._pad(batch)
        enc = {k: v.to(self.device) for k, v in tensors.items()}
        with torch.inference_mode():
            return self.module(**enc), enc["attention_mask"]

    def _padded_embeddings(self, batch: Sequence[Any]) -> torch.Tensor:
        out, attention = self._padded(batch)
        mask = attention.unsqueeze(-1).to(out.last_hidden_state.dtype)
        summed = (out.last_hidden_state * mask).sum(dim=1)
        pooled = summed / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)

    def _classify(self, logits: torch.Tensor) -> list[Any]:
        assert self.module is not None
        probs = logits.softmax(dim=-1).cpu()
        labels = self.module.config.id2label
        return [
            {"label": labels[int(p.argmax())], "score": float(p.max()), "scores": p.tolist()}
            for p in probs
        ]

    def probe(self) -> Any:
        return "ok"

    def sample(self, input_size: int, output_size: int = 0) -> Any:
        return " ".join(["word"] * max(1, input_size - 2))  # [CLS] ... [SEP]
