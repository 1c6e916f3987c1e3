"""``ember models import-hf`` against a live API over SQLite, from a Hugging Face hub cache
built here the way ``huggingface_hub`` lays it out (``refs/main``, ``snapshots/<commit>/``
links into ``blobs/``) and from a ``save_pretrained`` directory. Nothing reaches a hub."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.api.app import create_app
from ember.config import Settings
from ember.domain.manifest import Manifest, ManifestFile
from tests import services
from tests.api.conftest import ADMIN_KEY

torch = pytest.importorskip("torch")
from ember.engine.examples.mlp import build_mlp_directory  # noqa: E402

EMBER = str(Path(sys.executable).with_name("ember"))
MAIN = "a" * 40
OLD = "b" * 40
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "HF_"))} | env
    full["COLUMNS"] = "200"
    return subprocess.run([EMBER, *args], env=full, capture_output=True, text=True, timeout=180)


@pytest.fixture
def env(data_dir: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    settings = Settings(data_dir=data_dir, admin_key=ADMIN_KEY, pools_enabled=False)  # type: ignore[arg-type]
    with services.serve_app(create_app(settings)) as url:
        yield {"EMBER_URL": url, "EMBER_API_KEY": ADMIN_KEY, "EMBER_DATA_DIR": str(data_dir),
               "XDG_CACHE_HOME": str(tmp_path / "user-cache"),
               "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}  # fmt: skip


def checkpoint(folder: Path, config: dict[str, object] = LLAMA) -> dict[str, bytes]:
    """A sharded checkpoint as a model repository carries it, path -> bytes, with the
    files an import leaves out: an unlisted consolidated shard, pickles, code, flax."""
    build_mlp_directory(folder, shards=3, layers=5)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text('{"max_new_tokens": 8}')
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "README.md").write_text("# tiny\n")
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shutil.copy(shard, folder / "consolidated.safetensors")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    (folder / "modeling_tiny.py").write_text("import os\n")
    (folder / "flax_model.msgpack").write_bytes(b"\x81")
    (folder / "original").mkdir()
    (folder / "original" / "params.json").write_text('{"dim": 8}')
    (folder / "original" / "consolidated.00.pth").write_bytes(b"\x80\x04pickle")
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file()}  # fmt: skip


LEFT_OUT = {
    "consolidated.safetensors": "not in model.safetensors.index.json",
    "pytorch_model.bin": "a pickle: unpickling it can run arbitrary code",
    "original/consolidated.00.pth": "a pickle",
    "modeling_tiny.py": "Python code of the repository: Ember never runs a model's own code",
    "flax_model.msgpack": "not a file Ember's engines read",
}


def hub_entry(hub: Path, repo: str, files: dict[str, bytes], commit: str = MAIN) -> Path:
    """``models--org--name/`` as huggingface_hub writes it: each file a blob named by its
    digest, the snapshot's files relative links to them, ``refs/main`` the commit."""
    entry = hub / f"models--{repo.replace('/', '--')}"
    (entry / "blobs").mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        blob = entry / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = entry / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (entry / "refs").mkdir(exist_ok=True)
    if commit == MAIN:
        (entry / "refs" / "main").write_text(commit)
    return entry


def digest(files: dict[str, bytes]) -> str:
    return Manifest.of(
        ManifestFile(path=p, size=len(d), sha256=hashlib.sha256(d).hexdigest())
        for p, d in files.items()
    ).digest


def test_a_model_in_the_hub_cache_is_pushed_as_refs_main_says(
    env: dict[str, str], tmp_path: Path
) -> None:
    files = checkpoint(tmp_path / "src")
    hub = Path(env["HF_HUB_CACHE"])
    hub_entry(hub, "org/tiny", files)
    first_shard = sorted(f for f in files if f.startswith("model-"))[0]
    older = {"config.json": json.dumps(LLAMA).encode(), "model.safetensors": files[first_shard]}
    hub_entry(hub, "org/tiny", older, commit=OLD)

    imported = run(env, "models", "import-hf", "org/tiny", "-n", "tiny", "-v", "1", "--wait")
    assert imported.returncode == 0, imported.stderr
    said = " ".join(imported.stderr.split())
    for path, why in LEFT_OUT.items():
        assert f"left out {path}: {why}" in said
    assert "engine: vllm (config.json's architectures (LlamaForCausalLM): a causal LM" in said
    kept = {p: d for p, d in files.items() if p not in LEFT_OUT}
    assert sorted(kept) == sorted(
        ["config.json", "generation_config.json", "tokenizer.json", "README.md",
         "model.safetensors.index.json", "original/params.json",
         *(p for p in files if p.startswith("model-") and p.endswith(".safetensors"))]
    )  # fmt: skip
    row = json.loads(imported.stdout)
    assert row["status"] == "ready" and row["engine"] == "vllm"
    assert row["sha256"] == digest(kept)  # the files of the snapshot, links resolved
    store = Path(env["EMBER_DATA_DIR"]) / "objects" / "artifacts" / "default" / "tiny" / "1"
    for path, data in kept.items():
        assert not (store / path).is_symlink() and (store / path).read_bytes() == data
    assert not (store / "consolidated.safetensors").exists()

    # The older revision, by commit, from the cache entry's directory.
    entry = hub / "models--org--tiny"
    old = run(env, "models", "import-hf", str(entry), "-n", "tiny", "-v", "old",
              "--revision", OLD, "--wait")  # fmt: skip
    assert old.returncode == 0, old.stderr
    assert json.loads(old.stdout)["sha256"] == digest(older)


def test_links_out_of_the_cache_entrys_blobs_are_refused(
    env: dict[str, str], tmp_path: Path
) -> None:
    hub = Path(env["HF_HUB_CACHE"])
    files = checkpoint(tmp_path / "src")
    entry = hub_entry(hub, "org/tiny", files)
    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key = x")
    link = entry / "snapshots" / MAIN / "tokenizer.json"
    link.unlink()
    link.symlink_to(secret)
    refused = run(env, "models", "import-hf", "org/tiny", "-n", "tiny", "-v", "1")
    assert refused.returncode == 1
    said = " ".join(refused.stderr.split())
    assert "tokenizer.json is a link to" in said and "outside the cache entry's blobs/" in said

    # A blob of another entry is not this entry's either.
    other = hub_entry(hub, "org/other", {"tokenizer.json": b"{}"})
    link.unlink()
    link.symlink_to(next((other / "blobs").iterdir()))
    refused = run(env, "models", "import-hf", "org/tiny", "-n", "tiny", "-v", "1")
    said = " ".join(refused.stderr.split())  # the console wraps long paths
    assert refused.returncode == 1 and "outside the cache entry's blobs/" in said
    assert not (Path(env["EMBER_DATA_DIR"]) / "objects" / "artifacts").exists()  # nothing sent


def test_a_model_whose_only_weights_are_pickles_is_refused(
    env: dict[str, str], tmp_path: Path
) -> None:
    pickled = {"config.json": json.dumps(LLAMA).encode(), "pytorch_model.bin": b"\x80\x04x"}
    hub_entry(Path(env["HF_HUB_CACHE"]), "org/pickled", pickled)
    refused = run(env, "models", "import-hf", "org/pickled", "-n", "p", "-v", "1")
    assert refused.returncode == 1
    said = " ".join(refused.stderr.split())
    assert "org/pickled@aaaaaaaaaaaa has no safetensors weights" in said
    assert "its weights are pickles (pytorch_model.bin), which Ember refuses" in said
    assert "unpickling runs arbitrary code" in said

    missing = run(env, "models", "import-hf", "org/absent", "-n", "p", "-v", "1")
    assert missing.returncode == 1
    assert "not in the local Hugging Face cache" in missing.stderr
    assert "huggingface-cli download org/absent" in " ".join(missing.stderr.split())
    hostile = run(env, "models", "import-hf", "org/../../x", "-n", "p", "-v", "1")
    assert hostile.returncode == 1 and "neither a directory nor a repo id" in hostile.stderr


def test_a_save_pretrained_directory_is_imported_with_the_engine_its_config_implies(
    env: dict[str, str], tmp_path: Path
) -> None:
    folder = tmp_path / "bert"
    files = checkpoint(folder, {"architectures": ["BertModel"]})
    imported = run(env, "models", "import-hf", str(folder), "-n", "bert", "-v", "1", "--wait")
    assert imported.returncode == 0, imported.stderr
    row = json.loads(imported.stdout)
    assert row["status"] == "ready" and row["engine"] == "transformers"
    assert row["sha256"] == digest({p: d for p, d in files.items() if p not in LEFT_OUT})

    (folder / "config.json").write_text('{"architectures": ["BertForSequenceClassification"]}')
    dry = run(env, "models", "import-hf", str(folder), "-n", "bert", "-v", "2", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "engine: transformers (architectures (BertForSequenceClassification): a classifier" in (
        " ".join(dry.stderr.split())
    )
    assert "model.safetensors.index.json" in dry.stdout and "nothing uploaded" in dry.stderr
    (folder / "config.json").unlink()
    unsure = run(env, "models", "import-hf", str(folder), "-n", "bert", "-v", "2", "--dry-run")
    assert unsure.returncode == 1 and "no config.json: say which engine with --engine" in (
        unsure.stderr
    )
