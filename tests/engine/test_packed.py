"""The padding-free BERT forward computes what the padded forward with an attention mask
computes, and declines the structures it does not mirror."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from ember.engine import packed

transformers = pytest.importorskip("transformers")


def _bert(**overrides: Any) -> Any:
    config = transformers.BertConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, type_vocab_size=2, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertModel(config, add_pooling_layer=False).eval()


class _Encoding:  # the two fields of ``tokenizers.Encoding`` that packed reads
    def __init__(self, ids: list[int]) -> None:
        self.ids, self.type_ids = ids, [0] * len(ids)


def _batch(rows: list[list[int]], types: list[list[int]]) -> dict[str, torch.Tensor]:
    """``rows`` padded on the right, as a tokenizer with ``padding=True`` gives them."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    tt = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for i, (r, t) in enumerate(zip(rows, types, strict=True)):
        ids[i, : len(r)], tt[i, : len(t)], mask[i, : len(r)] = torch.tensor(r), torch.tensor(t), 1
    return {"input_ids": ids, "token_type_ids": tt, "attention_mask": mask}


def _padded(model: Any, rows: list[list[int]], types: list[list[int]]) -> torch.Tensor:
    batch = _batch(rows, types)
    with torch.inference_mode():
        out = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).to(out.dtype)
    return torch.nn.functional.normalize((out * m).sum(1) / m.sum(1), p=2, dim=1)


@pytest.mark.parametrize("lengths", [[1, 5, 9, 9, 2], [7, 7, 7], [12], [3, 40]])
def test_packed_matches_padded(lengths: list[int]) -> None:
    model = _bert()
    assert packed.fits(model)
    rng = np.random.default_rng(len(lengths))
    rows = [rng.integers(1, 120, n).tolist() for n in lengths]
    types = [rng.integers(0, 2, n).tolist() for n in lengths]
    got = packed.forward(
        model, np.concatenate(rows), np.concatenate(types), np.asarray(lengths), "cpu"
    )
    want = _padded(model, rows, types)
    assert got.shape == (len(lengths), 32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_pooled_reads_tokenizers_encodings() -> None:
    model = _bert()
    rows = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    got = packed.pooled(model, [_Encoding(r) for r in rows], "cpu")
    torch.testing.assert_close(got, _padded(model, rows, [[0] * 3, [0] * 6]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: _bert(is_decoder=True),
        lambda: _bert(chunk_size_feed_forward=4),
        lambda: transformers.DistilBertModel(
            transformers.DistilBertConfig(
                vocab_size=50, dim=32, n_layers=1, n_heads=4, hidden_dim=64
            )
        ),
        lambda: torch.nn.Linear(2, 2),
    ],
)
def test_declines_what_it_does_not_mirror(make: Any) -> None:
    assert not packed.fits(make())


def test_classifier_logits_match_padded() -> None:
    config = transformers.BertConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    assert packed.fits_classifier(model) and not packed.fits_classifier(_bert())
    rows = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    got = packed.logits(model, [_Encoding(r) for r in rows], "cpu")
    with torch.inference_mode():
        want = model(**_batch(rows, [[0] * len(r) for r in rows])).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
