"""Directory versions: a manifest of files, registered over the API, and hostile ones
refused precisely (422 naming the file and the tensor), nothing stored."""

from __future__ import annotations

import hashlib
import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from ember.domain.manifest import Manifest
from ember.registry import validation
from tests.api.conftest import MLP, Api
from tests.api.test_models import problem
from tests.artifacts import write_sharded, write_valid

A = "model-00001-of-00002.safetensors"
B = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


def _register(api: Api, uri: str, version: str = "1", **extra: object) -> object:
    api.admin.post("/v1/models", json={"name": "m"})
    body = {"version": version, "artifact_uri": uri, "engine": "torch", "engine_config": MLP}
    return api.admin.post("/v1/models/m/versions", json={**body, **extra})


def _digests(folder: Path) -> Manifest:
    return Manifest.of(
        {"path": p.relative_to(folder).as_posix(), "size": p.stat().st_size,
         "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in folder.rglob("*") if p.is_file()
    )  # fmt: skip


def test_a_directory_registers_as_a_manifest(api: Api, store_dir: Path) -> None:
    folder = store_dir / "llm"
    write_sharded(folder, {A: ["a.weight", "a.bias"], B: ["b.weight"]})
    (folder / "tokenizer.json").write_text("{}")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs")  # hidden: not the version's
    manifest = Manifest.of(f for f in _digests(folder).files if not f.path.startswith("."))
    # Named without the trailing slash: still the directory, stored with it.
    response = _register(api, folder.as_uri(), sha256=manifest.digest)
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["status"] == "ready" and body["artifact_uri"] == folder.as_uri() + "/"
    assert body["sha256"] == manifest.digest
    assert body["tensor_count"] == 3 and body["size_bytes"] == manifest.size
    assert [f["path"] for f in body["files"]] == sorted(
        [A, B, "config.json", INDEX, "tokenizer.json"]
    )
    for f in body["files"]:
        assert f["sha256"] == hashlib.sha256((folder / f["path"]).read_bytes()).hexdigest()
    # The manifest is the version's identity: a changed file is another digest.
    (folder / "config.json").write_text('{"model_type": "changed"}')
    wrong = _register(api, folder.as_uri() + "/", version="2", sha256=manifest.digest)
    assert "sha256 mismatch" in str(problem(wrong, 422, "invalid-artifact")["detail"])


def test_a_single_file_version_records_its_sidecars(api: Api, store_dir: Path) -> None:
    weights = write_valid(store_dir / "one" / "model.safetensors")
    (weights.parent / "config.json").write_text('{"model_type": "bert"}')
    (weights.parent / "unrelated.txt").write_text("not a sidecar")
    response = _register(api, weights.as_uri())
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()  # unchanged
    assert [f["path"] for f in body["files"]] == ["model.safetensors", "config.json"]


def test_a_large_directory_validates_in_the_background(api: Api, store_dir: Path) -> None:
    folder = store_dir / "big"
    write_sharded(folder, {A: ["a"], B: ["b"]}, rows=20_000)  # 1.3 MB > the inline limit
    response = _register(api, folder.as_uri() + "/")
    assert response.status_code == 202 and response.json()["status"] == "pending"
    deadline = time.monotonic() + 30
    while (row := api.admin.get("/v1/models/m/versions/1").json())["status"] == "pending":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert row["status"] == "ready" and row["sha256"] == _digests(folder).digest


def _hostile(folder: Path, case: str) -> None:
    if case == "shard missing":
        write_sharded(folder, {A: ["a"], B: ["b"]})
        (folder / B).unlink()
    elif case == "shard unlisted":
        write_sharded(folder, {A: ["a"], B: ["b"]}, index={"a": A})
    elif case == "tensor in two shards":
        write_sharded(folder, {A: ["a", "shared"], B: ["b", "shared"]}, index={"a": A, "b": B})
    elif case == "tensor not where the index says":
        write_sharded(folder, {A: ["a"], B: ["b"]}, index={"a": B, "b": B})
    elif case == "tensor missing from the index":
        write_sharded(folder, {A: ["a", "extra"], B: ["b"]}, index={"a": A, "b": B})
    elif case == "index names a tensor no shard has":
        write_sharded(folder, {A: ["a"], B: ["b"]}, index={"a": A, "b": B, "ghost": B})
    elif case == "index points outside the directory":
        write_sharded(folder, {A: ["a"], B: ["b"]}, index={"a": A, "b": "../other/" + B})
    elif case == "index points at a non-shard":
        write_sharded(folder, {A: ["a"], B: ["b"]}, index={"a": A, "b": "config.json"})
    elif case == "truncated shard":
        write_sharded(folder, {A: ["a"], B: ["b"]})
        data = (folder / B).read_bytes()
        (folder / B).write_bytes(data[:-7])
    elif case == "two shards, no index":
        write_sharded(folder, {A: ["a"], B: ["b"]})
        (folder / INDEX).unlink()
    elif case == "no weights":
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    elif case == "index is not json":
        write_sharded(folder, {A: ["a"], B: ["b"]})
        (folder / INDEX).write_text("{nope")
    elif case == "wrong total_size":
        write_sharded(folder, {A: ["a"], B: ["b"]}, total_size=12345)
    elif case == "too deep":
        write_valid(folder / "model.safetensors")
        write_valid(folder / "a" / "b" / "c" / "d" / "x.safetensors")
    elif case == "a link out of the store":
        write_sharded(folder, {A: ["a"], B: ["b"]})
        outside = folder.parent.parent.parent / "secret.json"
        outside.write_text("{}")
        (folder / "tokenizer.json").symlink_to(outside)
    elif case == "million-entry index":
        write_sharded(folder, {A: ["a"], B: ["b"]})
        weight_map = {f"model.layers.{i}.mlp.weight": A for i in range(1_000_000)}
        (folder / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    else:
        raise AssertionError(case)


HOSTILE = {
    "shard missing": ("invalid-artifact", B, "does not have"),
    "shard unlisted": ("invalid-artifact", B, "is not listed in"),
    "tensor in two shards": ("invalid-artifact", "shared", "in two shards"),
    "tensor not where the index says": ("invalid-artifact", "'a'", "it is in " + A),
    "tensor missing from the index": ("invalid-artifact", "'extra'", "is not in " + INDEX),
    "index names a tensor no shard has": ("invalid-artifact", "'ghost'", "does not hold it"),
    "index points outside the directory": ("invalid-artifact", "'b'", "not a .safetensors file"),
    "index points at a non-shard": ("invalid-artifact", "'b'", "not a .safetensors file"),
    "truncated shard": ("invalid-artifact", B + ": tensor 'b'", "out of range"),
    "two shards, no index": ("invalid-artifact", "2 top-level", "no *.safetensors.index.json"),
    "no weights": ("invalid-artifact", ".safetensors", "no weights"),
    "index is not json": ("invalid-artifact", INDEX, "not a JSON document"),
    "wrong total_size": ("invalid-artifact", INDEX, "total_size is 12345"),
    "too deep": ("invalid-artifact", "a/b/c/d/x.safetensors", "at most 4 components"),
    "a link out of the store": ("store-access-denied", "tokenizer.json", ""),
    "million-entry index": ("invalid-artifact", INDEX, "more than an index"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_directories_are_refused_precisely(api: Api, store_dir: Path, case: str) -> None:
    folder = store_dir / "bad"
    _hostile(folder, case)
    code, names, reason = HOSTILE[case]
    detail = str(problem(_register(api, folder.as_uri() + "/"), 422, code)["detail"])
    assert names in detail and reason in detail, detail
    assert str(store_dir) not in detail.replace(folder.as_uri(), "")  # no server path beyond
    problem(api.admin.get("/v1/models/m/versions/1"), 404, "not-found")


def test_a_huge_index_is_refused_without_parsing_it(api: Api, store_dir: Path) -> None:
    """The 10^6-entry index is refused from its size: validating it allocates a small
    fraction of the files' size (it is never parsed into a million Python objects)."""
    folder = store_dir / "huge"
    _hostile(folder, "million-entry index")
    total = sum(p.stat().st_size for p in folder.iterdir())
    tracemalloc.start()
    try:
        with pytest.raises(Exception, match="more than an index"):
            validation.inspect_artifact(folder.as_uri() + "/", api.settings, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < total / 4, (peak, total)


def test_a_tenant_registers_only_directories_under_its_own_prefix(
    api: Api, store_dir: Path
) -> None:
    """A directory is confined like a file: under the tenant's prefix, every file of it;
    another tenant's directory (or one linking into it) is refused, and the refusal is the
    same whether or not it exists."""
    acme = api.tenant_client("acme")
    own = store_dir / "artifacts" / "acme" / "llm"
    write_sharded(own, {A: ["a"], B: ["b"]})
    theirs = store_dir / "artifacts" / "other" / "llm"
    write_sharded(theirs, {A: ["a"], B: ["b"]})
    acme.post("/v1/models", json={"name": "m"})
    body = {"engine": "torch", "engine_config": MLP}

    def register(version: str, folder: Path) -> Any:
        uri = folder.as_uri() + "/"
        return acme.post("/v1/models/m/versions",
                         json={**body, "version": version, "artifact_uri": uri})  # fmt: skip

    ok = register("1", own)
    assert ok.status_code == 201, ok.text
    details: list[str] = []
    for target in (theirs, store_dir / "artifacts" / "other" / "nothing-here"):
        refused = register("2", target)
        detail = str(problem(refused, 422, "store-access-denied")["detail"])
        details.append(detail.replace(target.as_uri(), "URI"))
        assert "artifacts/other" not in details[-1]
    assert details[0] == details[1]  # says nothing of what exists there
    (own / "tokenizer.json").symlink_to(theirs / "config.json")  # a link out of the prefix
    problem(register("3", own), 422, "store-access-denied")
