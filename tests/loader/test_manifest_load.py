"""Directory versions through the loader: every shard of a manifest from the store (file://
and moto S3) through the NVMe cache into the device, per-file entries keyed by the
manifest, single-flight across processes, a flipped bit caught and only its shard
refetched, sidecars only from the verified manifest."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from pathlib import Path
from typing import Any

import boto3
import pytest

from ember.config import Settings
from ember.domain.spec import VersionSpec
from ember.errors import ArtifactError, LoaderError
from ember.loader.cache import EntryPinned, WeightCache
from ember.loader.load import WeightLoader
from ember.registry import validation
from tests.loader.conftest import FaultyProxy, assert_same, s3_settings

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

SHARDS = 4


def write_checkpoint(folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A 4-shard checkpoint split as save_pretrained splits it, with its index, a config
    and a tokenizer file: the layout large models ship in."""
    from huggingface_hub import split_torch_state_dict_into_shards

    gen = torch.Generator().manual_seed(seed)
    kinds = (("w", torch.bfloat16), ("b", torch.float32))
    sd = {f"layers.{i}.{kind}": torch.randn(96 + i, 64, generator=gen).to(dtype)
          for i in range(8) for kind, dtype in kinds}  # fmt: skip
    total = sum(t.numel() * t.element_size() for t in sd.values())
    split = split_torch_state_dict_into_shards(sd, max_shard_size=total // SHARDS + 1)
    folder.mkdir(parents=True, exist_ok=True)
    for name, tensors in split.filename_to_tensors.items():
        save_file({n: sd[n] for n in tensors}, str(folder / name), metadata={"format": "pt"})
    import json

    index = {"metadata": {"total_size": total}, "weight_map": split.tensor_to_filename}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    assert len(list(folder.glob("*.safetensors"))) >= 3
    return sd


def spec_for(uri: str, settings: Settings, version: str = "1") -> VersionSpec:
    facts = validation.inspect_artifact(uri, settings, None)
    return VersionSpec(model="m", version=version, artifact_uri=uri, sha256=facts.sha256,
                       files=facts.files, engine="torch")  # fmt: skip


@pytest.fixture
def local(data_dir: Path) -> tuple[Settings, Path, dict[str, torch.Tensor]]:
    folder = data_dir / "objects" / "llm"
    sd = write_checkpoint(folder)
    return Settings(data_dir=data_dir), folder, sd


def test_a_directory_streams_whole_through_the_cache(local: Any) -> None:
    settings, folder, sd = local
    spec = spec_for(folder.as_uri() + "/", settings)
    loader = WeightLoader(settings)
    first = loader.load_version(spec)
    assert first.report.cache == "miss" and first.report.tensors == len(sd)
    assert first.report.sha256 == spec.sha256  # the version's identity: the manifest's digest
    assert_same(first.tensors, sd)
    # Per-file entries, each keyed by model, version, its sha256 and the manifest.
    entries = WeightCache.from_settings(settings).ls()
    assert {e.key.manifest for e in entries} == {spec.sha256}
    assert sorted(e.key.sha256 for e in entries) == sorted(f.sha256 for f in spec.files or ())
    assert all(e.complete and e.pinned for e in entries)  # pinned while in use
    with pytest.raises(EntryPinned):
        loader.cache.evict("m", "1")
    first.pin.release()  # type: ignore[union-attr]
    second = loader.load_version(spec)
    assert second.report.cache == "hit" and second.report.bytes_fetched == 0
    assert_same(second.tensors, sd)
    second.pin.release()  # type: ignore[union-attr]
    # Sidecars: links to the verified entries, named as the version's files; no weights.
    tree = loader.files_dir(spec)
    assert sorted(p.name for p in tree.iterdir()) == [
        "config.json", "model.safetensors.index.json", "tokenizer.json"]  # fmt: skip
    assert (tree / "config.json").read_bytes() == (folder / "config.json").read_bytes()


def test_into_fills_a_modules_own_memory_across_shards(local: Any) -> None:
    settings, folder, sd = local
    spec = spec_for(folder.as_uri() + "/", settings)
    targets = {n: torch.empty_like(t) for n, t in sd.items()}
    loaded = WeightLoader(settings).load_version(spec, into=targets)
    assert_same(targets, sd)
    assert all(loaded.tensors[n].data_ptr() == targets[n].data_ptr() for n in sd)
    with pytest.raises(LoaderError, match="not in any shard"):
        WeightLoader(settings).load_version(spec, into={**targets, "extra": torch.empty(1)})


def test_a_flipped_bit_in_one_cached_shard_refetches_that_shard_alone(
    local: Any, data_dir: Path
) -> None:
    settings, folder, sd = local
    settings = Settings(data_dir=data_dir, cache_verify_after_s=0)  # every hit re-hashes
    spec = spec_for(folder.as_uri() + "/", settings)
    loader = WeightLoader(settings)
    loader.load_version(spec).pin.release()  # type: ignore[union-attr]
    victim = [f for f in spec.files or () if f.path.endswith(".safetensors")][1]
    cached = next(e for e in loader.cache.ls() if e.key.sha256 == victim.sha256)
    weights = cached.path / "weights.safetensors"
    # Hold each cached file open: a replaced file's inode stays allocated, so a new file
    # cannot reuse its number and look unchanged.
    held = {e.key.sha256: (e.path / "weights.safetensors").open("rb")
            for e in loader.cache.ls()}  # fmt: skip
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10
    weights.write_bytes(bytes(data))
    again = loader.load_version(spec)
    assert again.report.cache == "refetched"
    assert again.report.bytes_fetched == victim.size  # that shard's bytes, no other
    assert_same(again.tensors, sd)
    after = {e.key.sha256: (e.path / "weights.safetensors").stat().st_ino
             for e in loader.cache.ls()}  # fmt: skip
    changed = {sha for sha, f in held.items() if os.fstat(f.fileno()).st_ino != after[sha]}
    for f in held.values():
        f.close()
    assert changed == {victim.sha256}


def test_a_manifest_that_is_not_the_registered_one_is_refused(local: Any) -> None:
    settings, folder, _ = local
    spec = spec_for(folder.as_uri() + "/", settings)
    files = list(spec.files or ())
    files[0] = files[0].model_copy(update={"sha256": "0" * 64})
    forged = spec.model_copy(update={"files": tuple(files)})
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        WeightLoader(settings).load_version(forged)
    assert WeightCache.from_settings(settings).ls() == []  # nothing was read


def test_a_shard_changed_in_the_store_is_caught(local: Any) -> None:
    settings, folder, _ = local
    spec = spec_for(folder.as_uri() + "/", settings)
    shard = sorted(folder.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # same size, other bytes: the fill's digest disagrees
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=f"{shard.name}.*sha256"):
        WeightLoader(settings).load_version(spec)
    shard.write_bytes(bytes(data[:-1]))  # truncated: its size disagrees before a read
    with pytest.raises(ArtifactError, match=f"{shard.name}.*manifest says"):
        WeightLoader(settings).load_version(spec)


# --- S3 ----------------------------------------------------------------------------


def _upload_dir(endpoint: str, bucket: str, prefix: str, folder: Path) -> str:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for path in folder.iterdir():
        s3.upload_file(str(path), bucket, f"{prefix}/{path.name}")
    return f"s3://{bucket}/{prefix}/"


def _tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _child(settings: dict[str, Any], spec: dict[str, Any], start: Any, out: Any) -> None:
    loaded = WeightLoader(Settings(**settings)).load_version(VersionSpec(**spec))
    start.wait(60)
    out.put((loaded.report.cache, loaded.report.bytes_fetched, _tensor_digest(loaded.tensors)))


@pytest.fixture
def s3_dir(
    data_dir: Path, tmp_path: Path, faulty_proxy: FaultyProxy, bucket: str
) -> tuple[Settings, Path, dict[str, torch.Tensor], VersionSpec]:
    """The checkpoint in moto (behind the faulty proxy), registered: settings, local copy,
    tensors, spec."""
    folder = tmp_path / "llm"
    sd = write_checkpoint(folder)
    uri = _upload_dir(faulty_proxy.upstream, bucket, "models/llm", folder)
    settings = s3_settings(data_dir, faulty_proxy.url)
    return settings, folder, sd, spec_for(uri, settings)


@pytest.mark.s3
def test_two_processes_filling_one_directory_download_each_file_once(
    data_dir: Path, faulty_proxy: FaultyProxy, s3_dir: Any
) -> None:
    _, folder, sd, spec = s3_dir
    assert [f.path for f in spec.files or ()] == sorted(p.name for p in folder.iterdir())
    faulty_proxy.gets = 0
    faulty_proxy.delay_s = 0.2  # both processes are inside the load while the fills run
    raw = {"data_dir": str(data_dir), "s3_endpoint_url": faulty_proxy.url,
           "s3_allowed_buckets": "*", "s3_part_size_bytes": 5 * 1024 * 1024}  # fmt: skip
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(raw, spec.model_dump(), start, out))
             for _ in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    files = spec.files or ()
    assert sum(r[1] for r in results) == sum(
        f.size for f in files if f.path.endswith(".safetensors")
    )
    assert faulty_proxy.gets == len(files)  # every file fetched once, by one of the two
    assert results[0][2] == results[1][2] == _tensor_digest(sd)


@pytest.mark.s3
def test_an_s3_directory_loads_with_its_sidecars(faulty_proxy: FaultyProxy, s3_dir: Any) -> None:
    settings, folder, sd, spec = s3_dir
    faulty_proxy.faults = ["503", "cut"]  # retried, never mixed in
    loader = WeightLoader(settings)
    loaded = loader.load_version(spec)
    assert_same(loaded.tensors, sd)
    tree = loader.files_dir(spec)
    assert (tree / "tokenizer.json").read_text() == '{"version": "1.0"}'
    for f in load_file(str(sorted(folder.glob("*.safetensors"))[0])):
        assert f in loaded.tensors
