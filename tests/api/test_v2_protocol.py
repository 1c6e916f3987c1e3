"""The Open Inference Protocol (KServe v2 / Triton HTTP) on a live platform, called with
NVIDIA's official ``tritonclient[http]`` unchanged (JSON and binary tensors) and with raw
hostile requests. The MLP example is deployed behind the gateway (real replicas)."""

from __future__ import annotations

import gzip
import json
import struct
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

httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[http]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = [pytest.mark.slow]
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


def auth() -> dict[str, str]:
    """A fresh headers dict for tritonclient (which adds its own headers to the one given)."""
    return dict(AUTH)


OUTPUT_SCHEMA = {"name": "scores", "shape": [16], "dtype": "float32"}


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """One API with the pools controller: ``mlp`` versions 1 and 2 (2 declares its output)
    behind one deployment, version 2 as a 50 % canary."""
    data_dir = tmp_path_factory.mktemp("v2") / "ember-data"
    data_dir.mkdir()
    settings = Settings(data_dir=data_dir, admin_key=ADMIN_KEY, standby_replicas=0)  # type: ignore[arg-type]
    with services.serve_app(create_app(settings)) as url:
        client = httpx.Client(base_url=url, headers=AUTH, timeout=60)
        live = Live(url, client, data_dir / "objects")
        live.register("mlp", "1")
        path = live.register("mlp", "2")  # registered, never deployed
        body = {"version": "3", "artifact_uri": path.as_uri(), "engine": "torch",
                "engine_config": {"factory": "ember.engine.examples.mlp:mlp"},
                "input_schema": {"shape": [256], "dtype": "float32"},
                "output_schema": OUTPUT_SCHEMA}  # fmt: skip
        assert client.post("/v1/models/mlp/versions", json=body).status_code == 201
        deploy(live, "mlp")
        client.post("/v1/deployments/mlp:canary", json={"version": "3", "weight": 50})
        live.wait(lambda: bool(live.ready("mlp", "3")), "the canary's replica")
        yield live
        client.close()


@pytest.fixture
def triton(platform: Live) -> Iterator[Any]:
    client = httpclient.InferenceServerClient(platform.url.removeprefix("http://"),
                                              network_timeout=60.0)  # fmt: skip
    yield client
    client.close()


def _rows(n: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal((n, 256)).astype(np.float32)


def _predict(platform: Live, x: np.ndarray[Any, Any], version: str) -> np.ndarray[Any, Any]:
    out = platform.client.post(f"/v1/models/mlp/versions/{version}:predict",
                               json={"instances": x.tolist()})  # fmt: skip
    assert out.status_code == 200, out.text
    return np.asarray(out.json()["predictions"], dtype=np.float32)


def _infer_raw(
    platform: Live, body: bytes | dict[str, Any], headers: dict[str, str] | None = None,
    path: str = "/v2/models/mlp/versions/1/infer",
) -> httpx.Response:  # fmt: skip
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    return httpx.post(platform.url + path, content=raw, headers=AUTH | (headers or {}),
                      timeout=60)  # fmt: skip


def _json_tensor(x: np.ndarray[Any, Any], datatype: str = "FP32", name: str = "input") -> dict:
    return {"name": name, "shape": list(x.shape), "datatype": datatype,
            "data": x.flatten().tolist()}  # fmt: skip


# --- the official client, unchanged -----------------------------------------------------------


def test_health_and_metadata_with_tritonclient(platform: Live, triton: Any) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.get_server_metadata()["extensions"] == ["binary_tensor_data"]
    assert triton.is_model_ready("mlp", headers=auth())
    assert triton.is_model_ready("mlp", "3", headers=auth())
    assert not triton.is_model_ready("nope", headers=auth())
    assert not triton.is_model_ready("mlp", "9", headers=auth())
    assert not triton.is_model_ready("mlp")  # no key

    meta = triton.get_model_metadata("mlp", headers=auth())
    assert meta["versions"] == ["1", "3"] and meta["platform"] == "ember_torch"
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 256]}]
    v1 = triton.get_model_metadata("mlp", "1", headers=auth())
    assert v1["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1]}]
    v3 = triton.get_model_metadata("mlp", "3", headers=auth())
    assert v3["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 16]}]
    with pytest.raises(InferenceServerException, match="no deployment serves model 'nope'"):
        triton.get_model_metadata("nope", headers=auth())
    with pytest.raises(InferenceServerException) as denied:
        triton.get_model_metadata("mlp")
    assert denied.value.status() == "401"


def test_infer_json_tensors_matches_predict(platform: Live, triton: Any) -> None:
    x = _rows(3)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=False)
    wanted = [httpclient.InferRequestedOutput("output", binary_data=False)]
    result = triton.infer("mlp", [inp], model_version="1", outputs=wanted, headers=auth(),
                          request_id="r-1")  # fmt: skip
    got = result.as_numpy("output")
    assert got.shape == (3, 16) and got.dtype == np.float32
    np.testing.assert_allclose(got, _predict(platform, x, "1"), rtol=1e-6, atol=1e-6)
    response = result.get_response()
    assert response["model_name"] == "mlp" and response["model_version"] == "1"
    assert response["id"] == "r-1"
    assert "binary_data_size" not in json.dumps(response)


def test_infer_binary_tensors_matches_predict(platform: Live, triton: Any) -> None:
    x = _rows(5, seed=1)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    # No outputs named: the client asks for every output in binary.
    result = triton.infer("mlp", [inp], model_version="3", headers=auth())
    got = result.as_numpy("scores")
    assert got.shape == (5, 16)
    np.testing.assert_allclose(got, _predict(platform, x, "3"), rtol=1e-6, atol=1e-6)
    assert result.get_output("scores")["parameters"]["binary_data_size"] == 5 * 16 * 4
    # Binary in, JSON out; gzip on the way in.
    wanted = [httpclient.InferRequestedOutput("scores", binary_data=False)]
    again = triton.infer("mlp", [inp], model_version="3", outputs=wanted, headers=auth(),
                         request_compression_algorithm="gzip")  # fmt: skip
    np.testing.assert_array_equal(again.as_numpy("scores"), got)


def test_readme_client_with_a_bearer_plugin(platform: Live) -> None:
    from tritonclient._plugin import InferenceServerClientPlugin

    class Bearer(InferenceServerClientPlugin):  # as the README shows it
        def __call__(self, request: Any) -> None:
            request.headers["Authorization"] = f"Bearer {ADMIN_KEY}"

    client = httpclient.InferenceServerClient(platform.url.removeprefix("http://"))
    client.register_plugin(Bearer())
    try:
        x = _rows(4, seed=3)
        for binary in (True, False, True):  # the client's own header dicts never leak across calls
            inp = httpclient.InferInput("input", [4, 256], "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            result = client.infer("mlp", [inp], model_version="1")
            np.testing.assert_allclose(result.as_numpy("output"), _predict(platform, x, "1"),
                                       atol=1e-6)  # fmt: skip
    finally:
        client.close()


def test_unpinned_infer_follows_the_canary(platform: Live, triton: Any) -> None:
    x = _rows(1, seed=2)
    by_version = {v: _predict(platform, x, v) for v in ("1", "3")}
    seen = set()
    for _ in range(40):
        inp = httpclient.InferInput("input", [1, 256], "FP32")
        inp.set_data_from_numpy(x)
        result = triton.infer("mlp", [inp], headers=auth())
        version = result.get_response()["model_version"]
        name = "scores" if version == "3" else "output"
        np.testing.assert_allclose(result.as_numpy(name), by_version[version], atol=1e-6)
        seen.add(version)
    assert seen == {"1", "3"}  # P(one version 40 times at 50 %) = 2e-12


def test_answers_say_what_served_them(platform: Live) -> None:
    x = _rows(1)
    out = _infer_raw(platform, {"inputs": [_json_tensor(x)]})
    assert out.status_code == 200, out.text
    assert out.headers["content-type"] == "application/json"
    assert out.headers["x-ember-version"] == "1" and out.headers["x-ember-replica"]
    assert out.headers["x-ember-deployment"] == "mlp"
    assert out.headers["x-ember-rung"] and out.headers["x-ember-cache"]
    body = {"inputs": [_json_tensor(x)], "parameters": {"binary_data_output": True}}
    binary = _infer_raw(platform, body)
    assert binary.status_code == 200 and binary.headers["x-ember-version"] == "1"
    head = int(binary.headers["inference-header-content-length"])
    header = json.loads(binary.content[:head])
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 64}
    got = np.frombuffer(binary.content[head:], dtype="<f4").reshape(1, 16)
    np.testing.assert_allclose(got, np.asarray([out.json()["outputs"][0]["data"]]), atol=1e-6)


def test_no_content_type_is_json_and_nested_data_is_accepted(platform: Live) -> None:
    x = _rows(2)
    nested = {"inputs": [{"name": "input", "shape": [2, 256], "datatype": "FP32",
                          "data": x.tolist()}]}  # fmt: skip
    raw = httpx.Request("POST", platform.url + "/v2/models/mlp/versions/1/infer",
                        content=json.dumps(nested).encode(), headers=AUTH)  # fmt: skip
    assert "content-type" not in raw.headers
    with httpx.Client(timeout=60) as client:
        out = client.send(raw)
    assert out.status_code == 200, out.text
    assert out.json()["outputs"][0]["shape"] == [2, 16]


# --- hostile input: a precise 4xx, in both error shapes ---------------------------------------


def _assert_problem(response: httpx.Response, status: int, *needles: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["status"] == status and body["detail"] == body["error"]  # RFC 9457 + v2
    for needle in needles:
        assert needle in body["error"], body
    return body


def test_bad_tensors_are_400s(platform: Live) -> None:
    x = _rows(1)
    tensor = _json_tensor(x)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"inputs": [tensor | {"datatype": "FP99"}]}, "datatype 'FP99' is not one of"),
        ({"inputs": [tensor | {"datatype": "FP64"}]}, "has datatype FP64, the model takes FP32"),
        ({"inputs": [tensor | {"datatype": "BYTES", "shape": [1], "data": ["a"]}]},
         "has datatype BYTES"),
        ({"inputs": [tensor | {"shape": [1, 255]}]}, "has 256 elements, its shape [1, 255]"),
        ({"inputs": [_json_tensor(_rows(1)[:, :255])]}, "the model takes [-1, 256]"),
        ({"inputs": [tensor | {"shape": [256]}]}, "the model takes [-1, 256]"),
        ({"inputs": [tensor | {"shape": [0, 256], "data": []}]}, "batch dimension"),
        ({"inputs": [tensor | {"data": ["x"] * 256}]}, "FP32 data must be numbers"),
        ({"inputs": [tensor | {"data": [float("nan")] * 256}]}, "NaN"),
        ({"inputs": [tensor | {"name": "x"}]}, "one input named 'input'"),
        ({"inputs": [tensor, tensor]}, "one input named 'input'"),
        ({"inputs": [{k: v for k, v in tensor.items() if k != "data"}]}, "neither data nor"),
        ({"inputs": []}, "inputs"),
        ({"inputs": [tensor], "typo": 1}, "typo"),
        ({"inputs": [tensor], "outputs": [{"name": "nope"}]}, "unknown output 'nope'"),
        ({"inputs": [tensor], "outputs": [{"name": "output", "parameters":
                                           {"classification": 3}}]}, "classification"),
        ({"inputs": [tensor], "parameters": {"timeout": -5}}, "parameters.timeout"),
        ({"inputs": [tensor | {"parameters": {"shared_memory_region": "r"}}]}, "shared memory"),
    ]  # fmt: skip
    for body, needle in cases:
        _assert_problem(_infer_raw(platform, body), 400, needle)
    for raw, needle in [(b"{", "not valid JSON"), (b"[1]", "JSON object"), (b"", "no JSON")]:
        _assert_problem(_infer_raw(platform, raw), 400, needle)


def test_bad_binary_sections_are_400s(platform: Live) -> None:
    x = _rows(2)
    data = x.astype("<f4").tobytes()

    def binary(size: int, payload: bytes, length: str | None = None) -> httpx.Response:
        tensor = {"name": "input", "shape": [2, 256], "datatype": "FP32",
                  "parameters": {"binary_data_size": size}}  # fmt: skip
        head = json.dumps({"inputs": [tensor]}).encode()
        length = str(len(head)) if length is None else length
        return _infer_raw(platform, head + payload, {"Inference-Header-Content-Length": length})

    assert binary(len(data), data).status_code == 200
    _assert_problem(binary(len(data), data[:-10]), 400, "truncated")
    _assert_problem(binary(len(data) - 4, data[:-4]), 400, "do not make shape [2, 256]")
    _assert_problem(binary(len(data), data + b"xx"), 400, "2 bytes follow the last tensor")
    _assert_problem(binary(len(data), data, "999999"), 400, "but the body has")
    _assert_problem(binary(len(data), data, "-1"), 400, "is not a byte count")
    _assert_problem(binary(len(data), data, "12abc"), 400, "is not a byte count")
    _assert_problem(binary(-1, data), 400, "binary_data_size must be a byte count")
    # BYTES elements that run past their section
    head = json.dumps({"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES",
                                   "parameters": {"binary_data_size": 6}}]}).encode()  # fmt: skip
    broken = head + struct.pack("<I", 50) + b"ab"
    out = _infer_raw(platform, broken, {"Inference-Header-Content-Length": str(len(head))})
    _assert_problem(out, 400, "runs past its data")


def test_bad_encodings_and_sizes(platform: Live) -> None:
    body = json.dumps({"inputs": [_json_tensor(_rows(1))]}).encode()
    ok = _infer_raw(platform, gzip.compress(body), {"Content-Encoding": "gzip"})
    assert ok.status_code == 200, ok.text
    _assert_problem(_infer_raw(platform, body, {"Content-Encoding": "gzip"}), 400, "inflate")
    half = gzip.compress(body)[:-20]
    _assert_problem(_infer_raw(platform, half, {"Content-Encoding": "gzip"}), 400)
    _assert_problem(_infer_raw(platform, body, {"Content-Encoding": "br"}), 400, "br")
    bomb = gzip.compress(b" " * (11 * 1024 * 1024))  # inflates past the 10 MiB limit
    _assert_problem(_infer_raw(platform, bomb, {"Content-Encoding": "gzip"}), 413)
    big = b" " * (10 * 1024 * 1024 + 1)
    _assert_problem(_infer_raw(platform, big), 413, "limit")


def test_unknown_names_and_keys(platform: Live, triton: Any) -> None:
    body = {"inputs": [_json_tensor(_rows(1))]}
    _assert_problem(_infer_raw(platform, body, path="/v2/models/nope/infer"), 404, "nope")
    missing = _infer_raw(platform, body, path="/v2/models/mlp/versions/2/infer")
    _assert_problem(missing, 404, "version '2'")  # registered, not deployed
    _assert_problem(_infer_raw(platform, body, path="/v2/models/BAD!/infer"), 422)
    denied = httpx.post(platform.url + "/v2/models/mlp/infer", json=body)
    _assert_problem(denied, 401, "API key")
    wrong = httpx.post(platform.url + "/v2/models/mlp/infer", json=body,
                       headers={"Authorization": "Bearer ek_nope"})  # fmt: skip
    _assert_problem(wrong, 401)
    _assert_problem(httpx.get(platform.url + "/v2/nothing/here", headers=AUTH), 404)

    inp = httpclient.InferInput("input", [1, 255], "FP32")
    inp.set_data_from_numpy(_rows(1)[:, :255])
    with pytest.raises(InferenceServerException, match=r"the model takes \[-1, 256\]") as bad:
        triton.infer("mlp", [inp], headers=auth())
    assert bad.value.status() == "400"
    with pytest.raises(InferenceServerException, match="no deployment serves") as unknown:
        triton.infer("nope", [inp], headers=auth())
    assert unknown.value.status() == "404"


def test_another_tenant_sees_nothing(platform: Live) -> None:
    platform.client.post("/v1/tenants", json={"name": "other"})
    key = platform.client.post("/v1/keys", json={"tenant": "other"}).json()["key"]
    other = {"Authorization": f"Bearer {key}"}
    body = {"inputs": [_json_tensor(_rows(1))]}
    _assert_problem(_infer_raw(platform, body, other, "/v2/models/mlp/infer"), 404)
    meta = httpx.get(platform.url + "/v2/models/mlp", headers=other)
    _assert_problem(meta, 404)
