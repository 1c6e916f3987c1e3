"""The replica's tensor body (``application/x-ember-tensor``): the batch lane's form of
``/infer``. Same answers as JSON; hostile bodies are RFC 9457 problems, never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from ember.errors import MalformedRequest, PayloadTooLarge
from ember.web.tensorbody import MEDIA_TYPE, TensorBody, answer_body, parse
from tests.engine.conftest import StartEngine

PROBLEM = "application/problem+json"


def rows(n: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal((n, 256)).astype(np.float32)


def post_tensor(url: str, body: bytes, content_type: str, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{url}/infer", content=body, headers={"content-type": content_type, **headers}, timeout=60
    )


def test_parse_checks_every_part_of_the_body() -> None:
    body = TensorBody.of(rows(3))
    assert body.content_type == f"{MEDIA_TYPE}; dtype=float32; shape=3,256"
    assert len(body) == 3 and len(body.data) == 3 * 256 * 4
    again = parse(body.content_type, body.data, 10)
    assert np.array_equal(again.array(), rows(3)) and again.digest() == body.digest()
    bad = {
        "no dtype": (f"{MEDIA_TYPE}; shape=3,256", body.data),
        "unknown dtype": (f"{MEDIA_TYPE}; dtype=complex64; shape=3,256", body.data),
        "object dtype": (f"{MEDIA_TYPE}; dtype=object; shape=3,256", body.data),
        "no shape": (f"{MEDIA_TYPE}; dtype=float32", body.data),
        "zero rows": (f"{MEDIA_TYPE}; dtype=float32; shape=0,256", b""),
        "negative": (f"{MEDIA_TYPE}; dtype=float32; shape=-3,256", body.data),
        "not a number": (f"{MEDIA_TYPE}; dtype=float32; shape=3,abc", body.data),
        "superscript digit": (f"{MEDIA_TYPE}; dtype=float32; shape=3,2\u00b2", body.data),
        "too deep": (f"{MEDIA_TYPE}; dtype=float32; shape={','.join(['1'] * 9)}", b"\0" * 4),
        "huge dims": (f"{MEDIA_TYPE}; dtype=float32; shape=3,999999999,999999999", body.data),
        "truncated": (body.content_type, body.data[:-1]),
        "padded": (body.content_type, body.data + b"\0"),
        "wrong dtype size": (f"{MEDIA_TYPE}; dtype=float64; shape=3,256", body.data),
        "bare parameter": (f"{MEDIA_TYPE}; dtype", body.data),
        "other media type": ("application/octet-stream", body.data),
    }
    for why, (content_type, data) in bad.items():
        with pytest.raises(MalformedRequest):
            parse(content_type, data, 1_000_000)
            pytest.fail(why)
    with pytest.raises(PayloadTooLarge):
        parse(body.content_type, body.data, 2)


def test_tensor_body_answers_as_json_does(
    start_engine: StartEngine, mlp_spec: dict[str, Any]
) -> None:
    engine = start_engine(mlp_spec)
    x = rows(70)  # more than one forward pass (max_batch_size 32 by default)
    body = TensorBody.of(x)
    answer = post_tensor(engine.url, body.data, body.content_type, **{"x-ember-priority": "batch"})
    assert answer.status_code == 200, answer.text
    expected = httpx.post(f"{engine.url}/infer", json={"instances": x.tolist()}, timeout=60)
    assert answer.json()["predictions"] == expected.json()["predictions"]
    assert answer.json()["version"] == "1" and answer.headers["x-ember-version"] == "1"
    # float64 is cast to the schema's float32 (as JSON numbers are)
    wide = TensorBody.of(x.astype(np.float64))
    cast = post_tensor(engine.url, wide.data, wide.content_type)
    assert cast.status_code == 200 and cast.json()["predictions"] == expected.json()["predictions"]


def test_hostile_tensor_bodies_are_problems(
    start_engine: StartEngine, mlp_spec: dict[str, Any]
) -> None:
    engine = start_engine(mlp_spec)
    body = TensorBody.of(rows(4))
    cases = {
        400: [
            (body.data[:-3], body.content_type, {}),  # truncated
            (body.data, f"{MEDIA_TYPE}; dtype=float32; shape=5,256", {}),  # wrong length
            (body.data, f"{MEDIA_TYPE}; dtype=uint128; shape=4,256", {}),  # wrong dtype
            (body.data, f"{MEDIA_TYPE}; shape=4,256", {}),  # no dtype
            (body.data, body.content_type, {"x-ember-timeout-ms": "soon"}),
            (body.data, body.content_type, {"x-ember-timeout-ms": "nan"}),
            (body.data, body.content_type, {"x-ember-timeout-ms": "-1"}),
        ],
        422: [
            (body.data, f"{MEDIA_TYPE}; dtype=float32; shape=4,16,16", {}),  # not the schema's
            (body.data, f"{MEDIA_TYPE}; dtype=float32; shape=1024", {}),
            (body.data, body.content_type, {"x-ember-priority": "urgent"}),
            (body.data, body.content_type, {"x-ember-priority": "health"}),
        ],
    }
    for status, attempts in cases.items():
        for data, content_type, headers in attempts:
            answer = post_tensor(engine.url, data, content_type, **headers)
            assert answer.status_code == status, (content_type, headers, answer.text)
            assert answer.headers["content-type"].startswith(PROBLEM)
            assert answer.json()["status"] == status and answer.json()["detail"]
    ok = post_tensor(engine.url, body.data, body.content_type, **{"x-ember-timeout-ms": "5000"})
    assert ok.status_code == 200


def test_a_tensor_answer_when_asked(start_engine: StartEngine, mlp_spec: dict[str, Any]) -> None:
    """``Accept: application/x-ember-tensor``: the predictions as one tensor body, the
    same numbers the JSON answer holds; model and version in the headers."""
    engine = start_engine(mlp_spec)
    x = rows(70)
    body = TensorBody.of(x)
    expected = httpx.post(f"{engine.url}/infer", json={"instances": x.tolist()}, timeout=60)
    asks = {"x-ember-priority": "batch", "accept": MEDIA_TYPE}
    answer = post_tensor(engine.url, body.data, body.content_type, **asks)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == f"{MEDIA_TYPE}; dtype=float64; shape=70,16"
    assert answer.headers["x-ember-model"] == "mlp" and answer.headers["x-ember-version"] == "1"
    got = parse(answer.headers["content-type"], answer.content, 70).array()
    assert got.tolist() == expected.json()["predictions"]  # bit for bit: float64 both ways
    # a JSON body may ask for a tensor answer too; without the header, JSON as before
    from_json = httpx.post(
        f"{engine.url}/infer", json={"instances": x[:3].tolist()}, headers={"accept": MEDIA_TYPE}
    )
    assert from_json.headers["content-type"].startswith(MEDIA_TYPE)
    plain = post_tensor(engine.url, body.data, body.content_type)
    assert plain.headers["content-type"] == "application/json"
    # errors stay problems whatever the caller accepts
    bad = post_tensor(engine.url, body.data[:-1], body.content_type, accept=MEDIA_TYPE)
    assert bad.status_code == 400 and bad.headers["content-type"] == PROBLEM


@pytest.mark.parametrize(
    ("predictions", "dtype", "shape"),
    [
        ([[0.5, 1.0], [2.0, -3.25]], "float64", (2, 2)),
        ([1.5, 2, 3], "float64", (3,)),  # ints among floats: JSON numbers, one float array
        ([[1, 2], [3, 4]], "int64", (2, 2)),
        ([[[1.0]], [[2.0]]], "float64", (2, 1, 1)),
    ],
)
def test_answer_body_is_what_json_carries(
    predictions: list[Any], dtype: str, shape: tuple[int, ...]
) -> None:
    tensor = answer_body(predictions)
    assert tensor is not None and tensor.dtype == dtype and tensor.shape == shape
    assert tensor.array().tolist() == predictions


@pytest.mark.parametrize(
    "predictions",
    [
        [],
        [[1.0, 2.0], [3.0]],  # ragged
        [True, False],
        [[True, False]],
        [{"label": "a", "score": 0.5}],
        ["text"],
        [None, 1.0],
        [[1.0, None]],
        [2**70],  # beyond int64
        [[2**64 - 1]],  # uint64 only
        [1, "2"],
    ],
)
def test_answer_body_leaves_the_rest_to_json(predictions: list[Any]) -> None:
    assert answer_body(predictions) is None
