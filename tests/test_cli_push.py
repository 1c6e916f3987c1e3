"""``ember models push DIR`` against a live API over SQLite: a sharded checkpoint to the
file store and to moto S3, registered as one manifest version; a bad directory refused
before a byte is uploaded; a refused registration says what it left where."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from ember.api.app import create_app
from ember.config import Settings
from ember.domain.manifest import Manifest
from ember.loader.upload import LocalFile, digest_files, list_directory
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.artifacts import write_sharded

torch = pytest.importorskip("torch")
from ember.engine.examples.mlp import build_mlp_directory  # noqa: E402

EMBER = str(Path(sys.executable).with_name("ember"))
TORCH = ("--engine", "torch", "--engine-config",
         '{"factory": "ember.engine.examples.mlp:mlp", "kwargs": {"layers": 5}}')  # fmt: skip
MIB = 1024 * 1024


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | env
    full["COLUMNS"] = "200"
    return subprocess.run([EMBER, *args], env=full, capture_output=True, text=True, timeout=180)


def serve(settings: Settings, env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    with services.serve_app(create_app(settings)) as url:
        yield env | {"EMBER_URL": url, "EMBER_API_KEY": ADMIN_KEY,
                     "XDG_CACHE_HOME": str(tmp_path / "user-cache")}  # fmt: skip


@pytest.fixture
def file_env(data_dir: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    settings = Settings(data_dir=data_dir, admin_key=ADMIN_KEY, pools_enabled=False,  # type: ignore[arg-type]
                        validate_inline_max_bytes=1024)  # fmt: skip
    yield from serve(settings, {"EMBER_DATA_DIR": str(data_dir)}, tmp_path)


def checkpoint(folder: Path) -> Path:
    """The MLP in 3 shards with an index, plus the files a real checkpoint carries."""
    build_mlp_directory(folder, shards=3, layers=5)
    (folder / "generation_config.json").write_text('{"max_new_tokens": 8}')
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # hidden: skipped
    return folder


def files_size(files: dict[str, LocalFile]) -> str:
    from rich.filesize import decimal

    return decimal(sum(f.size for f in files.values()))


def manifest_digest(folder: Path) -> str:
    files = digest_files(list_directory(folder, max_files=100))
    return Manifest.of(f.entry() for f in files).digest


def test_a_sharded_directory_pushed_to_the_file_store_is_one_manifest_version(
    file_env: dict[str, str], tmp_path: Path
) -> None:
    folder = checkpoint(tmp_path / "mlp")
    pushed = run(file_env, "models", "push", str(folder), "-n", "mlp", "-v", "1", *TORCH, "--wait")
    assert pushed.returncode == 0, pushed.stderr
    row = json.loads(pushed.stdout)
    store = Path(file_env["EMBER_DATA_DIR"]) / "objects" / "artifacts" / "default" / "mlp" / "1"
    assert row["status"] == "ready", row
    assert row["artifact_uri"] == store.as_uri() + "/"
    assert row["sha256"] == manifest_digest(folder)  # the server's manifest is the local one
    hashed = digest_files(list_directory(folder, max_files=100))
    assert row["files"] == [f.entry().model_dump() for f in hashed]  # hidden files left out
    assert row["tensor_count"] == 10  # 5 layers, weight and bias
    local = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and not p.name.startswith("."))  # fmt: skip
    assert len(local) >= 7 and f"uploaded {len(local)} files" in pushed.stderr
    assert sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file()) == local
    for rel in local:
        assert (store / rel).read_bytes() == (folder / rel).read_bytes()

    again = run(file_env, "models", "push", str(folder), "-n", "mlp", "-v", "1", *TORCH)
    assert again.returncode == 1 and "already exists" in again.stderr
    # The same files as another version: a new prefix, the same manifest digest.
    second = run(file_env, "models", "push", str(folder), "-n", "mlp", "-v", "2", *TORCH, "--wait")
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["sha256"] == row["sha256"]


@pytest.mark.s3
def test_a_sharded_directory_pushed_to_s3_goes_up_in_parallel_parts(
    moto_endpoint: str, data_dir: Path, tmp_path: Path
) -> None:
    bucket = "ember-push-dir"
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    folder = tmp_path / "ckpt"
    rows = (2 * 5 * MIB + MIB) // 32  # an 11 MiB shard: 3 parts of 5 MiB
    write_sharded(folder, {"model-00001-of-00002.safetensors": ["a"],
                           "model-00002-of-00002.safetensors": ["b", "c"]}, rows=rows)  # fmt: skip
    store_url = f"s3://{bucket}/team"
    settings = Settings(data_dir=data_dir, admin_key=ADMIN_KEY, pools_enabled=False,  # type: ignore[arg-type]
                        object_store_url=store_url, s3_endpoint_url=moto_endpoint)  # fmt: skip
    env = {"EMBER_DATA_DIR": str(tmp_path / "client"), "EMBER_OBJECT_STORE_URL": store_url,
           "EMBER_S3_ENDPOINT_URL": moto_endpoint, "EMBER_S3_PART_SIZE_BYTES": str(5 * MIB),
           "EMBER_S3_MAX_CONCURRENCY": "4"}  # fmt: skip
    for cli_env in serve(settings, env, tmp_path):
        pushed = run(cli_env, "models", "push", str(folder), "-n", "big", "-v", "1", *TORCH,
                     "--wait")  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
        again = run(cli_env, "models", "push", str(folder), "-n", "big", "-v", "2", *TORCH)
        assert again.returncode == 0, again.stderr
    row = json.loads(pushed.stdout)
    assert row["status"] == "ready"
    assert row["artifact_uri"] == f"s3://{bucket}/team/artifacts/default/big/1/"
    assert row["sha256"] == manifest_digest(folder)
    files = {f.path: f for f in digest_files(list_directory(folder, max_files=100))}
    parts = sum(-(-f.size // (5 * MIB)) for f in files.values() if f.size > 5 * MIB)
    assert parts == 3 + 5  # 11 MiB and 22 MiB shards; the index and config in one PUT each
    assert f"uploaded 4 files ({files_size(files)}, {parts} parts)" in pushed.stderr
    for path, f in files.items():
        head = client.head_object(Bucket=bucket, Key=f"team/artifacts/default/big/1/{path}")
        assert head["Metadata"] == {"sha256": f.sha256} and head["ContentLength"] == f.size
    shard = client.head_object(
        Bucket=bucket, Key="team/artifacts/default/big/1/model-00002-of-00002.safetensors"
    )
    assert shard["ETag"].strip('"').endswith("-5")  # 22 MiB in 5 MiB parts: multipart
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_bad_directory_is_refused_before_anything_is_uploaded(
    file_env: dict[str, str], tmp_path: Path
) -> None:
    store = Path(file_env["EMBER_DATA_DIR"]) / "objects"
    no_index = tmp_path / "no-index"
    write_sharded(no_index, {"a.safetensors": ["x"], "b.safetensors": ["y"]})
    (no_index / "model.safetensors.index.json").unlink()
    wrong = tmp_path / "wrong"
    write_sharded(wrong, {"a.safetensors": ["x"], "b.safetensors": ["y"]},
                  index={"x": "a.safetensors", "y": "a.safetensors"})  # fmt: skip
    unlisted = tmp_path / "unlisted"
    write_sharded(
        unlisted, {"a.safetensors": ["x"], "b.safetensors": ["y"]}, index={"x": "a.safetensors"}
    )
    linked = tmp_path / "linked"
    write_sharded(linked, {"a.safetensors": ["x"], "b.safetensors": ["y"]})
    (tmp_path / "secret").write_text("aws_secret_access_key = x")
    (linked / "tokenizer.json").symlink_to(tmp_path / "secret")
    cases = {
        no_index: "2 top-level .safetensors files and no *.safetensors.index.json",
        wrong: "tensor 'y' should be in a.safetensors, but it is in b.safetensors",
        unlisted: "shard b.safetensors is not listed in model.safetensors.index.json",
        linked: "tokenizer.json is a link to",
    }
    for folder, reason in cases.items():
        refused = run(file_env, "models", "push", str(folder), "-n", "bad", "-v", "1", *TORCH)
        assert refused.returncode == 1, refused.stdout
        assert reason in " ".join(refused.stderr.split()), refused.stderr
    assert not store.exists() or not any(p.is_file() for p in store.rglob("*"))
    assert json.loads(run(file_env, "models", "ls", "--json").stdout) == []  # no model either


def test_a_refused_registration_says_what_it_left_and_can_delete_it(
    data_dir: Path, tmp_path: Path
) -> None:
    # The MLP's factory is not one the server allows: the registration is refused.
    settings = Settings(data_dir=data_dir, admin_key=ADMIN_KEY, pools_enabled=False,  # type: ignore[arg-type]
                        engine_factories=["mycorp.models:*"])  # fmt: skip
    folder = checkpoint(tmp_path / "mlp")
    store = data_dir / "objects" / "artifacts" / "default" / "mlp" / "1"
    n = len(list_directory(folder, max_files=100))
    for env in serve(settings, {"EMBER_DATA_DIR": str(data_dir)}, tmp_path):
        refused = run(env, "models", "push", str(folder), "-n", "mlp", "-v", "1", *TORCH)
        assert refused.returncode == 1
        said = " ".join(refused.stderr.split())
        assert (
            f"the {n} files of this push" in said
            and f"stay in the store under {store.as_uri()}/" in said
        )
        assert "EMBER_ENGINE_FACTORIES" in said  # the server's reason, too
        assert "--delete-on-refusal" in said
        assert len([p for p in store.rglob("*") if p.is_file()]) == n

        deleted = run(env, "models", "push", str(folder), "-n", "mlp", "-v", "1", *TORCH,
                      "--delete-on-refusal")  # fmt: skip
        assert deleted.returncode == 1
        said = " ".join(deleted.stderr.split())
        assert f"skipped {n} already in the store" in said  # nothing sent again
        assert f"deleted the {n} files of this push from {store.as_uri()}/" in said
        assert [p for p in store.rglob("*") if p.is_file()] == []
