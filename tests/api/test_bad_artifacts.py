"""Hostile artifacts and URIs: each is a precise 422 and nothing is stored."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from tests.api.conftest import MLP, Api
from tests.api.test_models import problem
from tests.artifacts import raw_artifact, write_valid

F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}

BAD_FILES: dict[str, tuple[bytes, str]] = {
    "not safetensors": (b"this is a text file, not weights\n" * 3, "header declares"),
    "shorter than the length prefix": (b"\x01\x02", "shorter than the 8-byte"),
    "truncated data": (raw_artifact({"w": F32}, b"\0" * 4), "out of range"),
    "header longer than the file": (
        raw_artifact({"w": F32}, b"\0" * 8, declared_len=10_000),
        "truncated safetensors file",
    ),
    "header is a list": (raw_artifact([1, 2, 3]), "must be a JSON object"),
    "header is not json": (raw_artifact(b"{not json"), "not valid JSON"),
    "offsets out of range": (
        raw_artifact({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
        "out of range",
    ),
    "overlapping offsets": (
        raw_artifact(
            {"a": F32, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12
        ),
        "overlap",
    ),
    "unknown dtype": (
        raw_artifact({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
        "unknown dtype",
    ),
    "shape does not match bytes": (
        raw_artifact({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        "needs 12 bytes",
    ),
    "empty file": (b"", "shorter than the 8-byte"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_corrupt_artifacts_are_refused_precisely(api: Api, store_dir: Path, case: str) -> None:
    content, reason = BAD_FILES[case]
    path = store_dir / "bad.safetensors"
    path.write_bytes(content)
    api.admin.post("/v1/models", json={"name": "m"})
    body = {"version": "1", "artifact_uri": path.as_uri(), "engine": "torch", "engine_config": MLP}
    detail = problem(api.admin.post("/v1/models/m/versions", json=body), 422, "invalid-artifact")
    assert reason in str(detail["detail"]), detail
    problem(api.admin.get("/v1/models/m/versions/1"), 404, "not-found")


def test_missing_artifact(api: Api, store_dir: Path) -> None:
    api.admin.post("/v1/models", json={"name": "m"})
    body = {
        "version": "1",
        "artifact_uri": (store_dir / "nope").as_uri(),
        "engine": "torch",
        "engine_config": MLP,
    }
    problem(api.admin.post("/v1/models/m/versions", json=body), 422, "artifact-not-found")


def test_paths_escaping_the_store_are_refused(api: Api, store_dir: Path, tmp_path: Path) -> None:
    api.admin.post("/v1/models", json={"name": "m"})
    outside = write_valid(tmp_path / "outside" / "w.safetensors")
    (store_dir / "link.safetensors").symlink_to(outside)
    (store_dir / "linkdir").symlink_to(outside.parent, target_is_directory=True)
    uris = [
        f"file://{store_dir}/../outside/w.safetensors",
        f"file://{store_dir}/%2e%2e/outside/w.safetensors",
        (store_dir / "link.safetensors").as_uri(),
        (store_dir / "linkdir" / "w.safetensors").as_uri(),
        "file:///etc/passwd",
        "file://otherhost/etc/passwd",
        "file:relative/path",
    ]
    for uri in uris:
        body = {"version": "1", "artifact_uri": uri, "engine": "torch", "engine_config": MLP}
        response = api.admin.post("/v1/models/m/versions", json=body)
        detail = problem(response, 422, "store-access-denied")
        assert uri.split("//")[-1][:20] in str(detail["detail"]) or "file" in str(detail["detail"])
    problem(api.admin.get("/v1/models/m/versions/1"), 404, "not-found")


def test_unsupported_scheme(api: Api) -> None:
    api.admin.post("/v1/models", json={"name": "m"})
    body = {
        "version": "1",
        "artifact_uri": "http://example.com/w.safetensors",
        "engine": "torch",
        "engine_config": MLP,
    }
    problem(api.admin.post("/v1/models/m/versions", json=body), 422, "store-access-denied")


@pytest.mark.s3
def test_s3_bucket_not_allowed_by_configuration(api: Api, moto_endpoint: str) -> None:
    api.admin.post("/v1/models", json={"name": "m"})
    body = {
        "version": "1",
        "artifact_uri": "s3://not-ours/w.safetensors",
        "engine": "torch",
        "engine_config": MLP,
    }
    detail = problem(api.admin.post("/v1/models/m/versions", json=body), 422, "store-access-denied")
    assert "not-ours" in str(detail["detail"]) and "EMBER_S3_ALLOWED_BUCKETS" in str(
        detail["detail"]
    )


def test_malformed_json_and_unknown_fields(api: Api) -> None:
    raw = {"content-type": "application/json"}
    problem(
        api.admin.post("/v1/models", content=b'{"name": ', headers=raw), 400, "malformed-request"
    )
    problem(
        api.admin.post("/v1/models", content=b"\xff\xfe", headers=raw), 400, "malformed-request"
    )
    body = problem(api.admin.post("/v1/models", json={"name": "m", "colour": "red"}), 422,
                   "invalid-input")  # fmt: skip
    assert "colour" in str(body["detail"])
    problem(api.admin.post("/v1/models", json={"name": "Bad Name!"}), 422, "invalid-input")
    problem(api.admin.post("/v1/models", json=["name"]), 422, "invalid-input")
    problem(api.admin.post("/v1/models", content=b"name=m",
                           headers={"content-type": "application/x-www-form-urlencoded"}),
            415, "unsupported-media-type")  # fmt: skip
    assert api.admin.post("/v1/models", content=json.dumps({"name": "nohdr"}).encode(),
                          headers={"content-type": ""}).status_code in (201, 415)  # fmt: skip


def test_oversized_requests_are_refused_before_they_are_read(api: Api) -> None:
    big = {"name": "m", "description": "x" * (300 * 1024)}
    problem(api.admin.post("/v1/models", json=big), 413, "payload-too-large")

    def chunks():  # no Content-Length: the limit is enforced while streaming
        for _ in range(100):
            yield b" " * 4096

    response = api.admin.post(
        "/v1/models", content=chunks(), headers={"content-type": "application/json"}
    )
    problem(response, 413, "payload-too-large")


def test_unknown_version_and_model(api: Api) -> None:
    problem(api.admin.get("/v1/models/nope"), 404, "not-found")
    api.admin.post("/v1/models", json={"name": "m"})
    problem(api.admin.get("/v1/models/m/versions/9"), 404, "not-found")
    body = {"version": "1", "artifact_uri": "file:///x", "engine": "torch", "engine_config": MLP}
    problem(api.admin.post("/v1/models/nope/versions", json=body), 404, "not-found")


def test_header_length_bomb_does_not_allocate(api: Api, store_dir: Path) -> None:
    """A prefix claiming an 8 EiB header must be refused from the 8 bytes alone."""
    path = store_dir / "bomb.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    api.admin.post("/v1/models", json={"name": "m"})
    body = {"version": "1", "artifact_uri": path.as_uri(), "engine": "torch", "engine_config": MLP}
    detail = problem(api.admin.post("/v1/models/m/versions", json=body), 422, "invalid-artifact")
    assert "limit" in str(detail["detail"])
    os.remove(path)
