"""The loader's device path on the device: safetensors bytes into CUDA memory through the
pinned staging ring and a side stream per placement worker, from a local file (cold:
O_DIRECT into the pinned slots; cached: through the page cache), through the NVMe cache
(a miss streams the object store's chunks to the device as they arrive; a hit places the
cache file), into a module's own memory, and a sharded directory version whole. Every
tensor is compared byte for byte with safetensors' own load.

Small chunks (1 MiB) and a small ring (8 slots) over a ~40 MiB file: each slot is reused
several times within one load, so a slot handed back before its copy finished would show
as wrong bytes."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file as st_load
from safetensors.torch import save_file

from ember.config import Settings
from ember.domain.spec import VersionSpec
from ember.loader import device as dev
from ember.loader.load import WeightLoader, load_file, module_destinations
from ember.registry import validation
from tests.gpu.cuda import (
    DEVICE,
    MIB,
    ON_CUDA,
    assert_same_bytes,
    cuda_only,
    drop_pages,
    needs_device,
    on_device,
    sha256_of,
)

pytestmark = needs_device
Record = Callable[[str, object], None]


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """~40 MiB of the dtypes and odd shapes real checkpoints hold (zero-dim, empty, bool,
    tensors that straddle chunk boundaries)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(2048, 2048, generator=gen),
        "layers.0.w": torch.randn(4096, 1024, generator=gen).to(torch.bfloat16),
        "layers.1.w": torch.randn(1024, 3001, generator=gen).to(torch.float16),
        "layers.1.bias": torch.randn(3, generator=gen),
        "steps": torch.arange(7, dtype=torch.int64),
        "mask": torch.rand(5, 3, generator=gen) > 0.5,
        "scale": torch.tensor(0.125),
        "empty": torch.empty(0, 4),
        "head.weight": torch.randn(1000, 2600, generator=gen),
    }


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpu-loader") / "model.safetensors"
    save_file(checkpoint(), str(path))
    return path


@pytest.fixture
def settings(data_dir: Path) -> Settings:
    return Settings(data_dir=data_dir, loader_chunk_bytes=MIB, loader_staging_bytes=8 * MIB,
                    loader_threads=4)  # fmt: skip


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The stream of every staged copy the loader makes (the real copy still runs)."""
    seen: list[Any] = []
    real = dev._copy_out

    def spy(plan: Any, dest: Any, src: Any, offset: int, data: Any, stream: Any) -> None:
        seen.append(stream)
        real(plan, dest, src, offset, data, stream)

    monkeypatch.setattr(dev, "_copy_out", spy)
    return seen


def assert_side_streams(streams: list[Any]) -> None:
    """On CUDA every staged copy ran on a stream of its own, never the default stream."""
    if not ON_CUDA:
        return
    assert streams, "no copy went through the staging ring"
    default = torch.cuda.default_stream(DEVICE)
    assert all(isinstance(s, torch.cuda.Stream) for s in streams)
    assert all(s != default for s in streams)


def stage_names(report: Any) -> list[str]:
    return [s.name for s in report.stages]


@pytest.mark.parametrize("pages", ["cold", "cached"])
def test_a_file_lands_on_the_device_byte_for_byte(
    artifact: Path, settings: Settings, copies: list[Any], pages: str, record_property: Record
) -> None:
    if pages == "cold":
        drop_pages(artifact)
    else:
        artifact.read_bytes()
    loaded = load_file(artifact, device=str(DEVICE), settings=settings)
    assert_same_bytes(loaded.tensors, st_load(str(artifact)))
    report = loaded.report
    assert (report.device, report.cache) == (str(DEVICE), "bypass")
    assert report.tensors == len(checkpoint())
    assert report.bytes == sum(t.nbytes for t in checkpoint().values())
    # On the CPU a cached file is mapped, not placed; on CUDA it is always placed.
    assert stage_names(report) in (["place", "total"], ["map", "total"])
    if ON_CUDA:
        assert stage_names(report) == ["place", "total"]
    assert_side_streams(copies)
    record_property(f"load_{pages}_gbps", round(report.gbps, 3))


@cuda_only
def test_the_staging_ring_is_pinned_and_reused(artifact: Path, settings: Settings) -> None:
    load_file(artifact, device=str(DEVICE), settings=settings)
    key = (str(torch.device(str(DEVICE))), settings.loader_staging_bytes,
           settings.loader_chunk_bytes)  # fmt: skip
    pool = dev._pools[key]  # the load made it: the process's ring for this device
    assert len(pool.slots) == settings.loader_staging_bytes // settings.loader_chunk_bytes
    for slot in pool.slots:
        assert slot.is_pinned() and slot.device.type == "cpu"
        assert slot.data_ptr() % 4096 == 0 and slot.numel() == settings.loader_chunk_bytes
    taken: list[int] = []
    real_acquire = pool.acquire

    def acquire() -> int:
        taken.append(real_acquire())
        return taken[-1]

    pool.acquire = acquire  # type: ignore[method-assign]
    try:
        loaded = load_file(artifact, device=str(DEVICE), settings=settings)
    finally:
        del pool.acquire
    # More chunks than slots: slots came back and were taken again, and no byte suffered.
    assert len(taken) > len(pool.slots) and set(taken) <= set(range(len(pool.slots)))
    assert_same_bytes(loaded.tensors, st_load(str(artifact)))


def test_through_the_cache_a_miss_streams_and_a_hit_places(
    artifact: Path, settings: Settings, copies: list[Any], record_property: Record
) -> None:
    stored = settings.data_dir / "objects" / "gpu" / "1" / "model.safetensors"
    stored.parent.mkdir(parents=True)
    shutil.copyfile(artifact, stored)
    digest, want = sha256_of(stored), st_load(str(artifact))
    loader = WeightLoader(settings)
    miss = loader.load("gpu", "1", stored.as_uri(), digest, device=str(DEVICE))
    assert miss.report.cache == "miss" and "fetch" in stage_names(miss.report)
    assert_same_bytes(miss.tensors, want)
    assert_side_streams(copies)
    assert miss.pin is not None
    miss.pin.release()
    copies.clear()
    hit = loader.load("gpu", "1", stored.as_uri(), digest, device=str(DEVICE))
    assert hit.report.cache == "hit" and "fetch" not in stage_names(hit.report)
    assert_same_bytes(hit.tensors, want)
    assert_side_streams(copies)
    record_property("cache_miss_s", round(miss.report.seconds, 4))
    record_property("cache_hit_s", round(hit.report.seconds, 4))


def test_into_a_modules_own_memory_on_the_device(tmp_path: Path, settings: Settings) -> None:
    gen = torch.Generator().manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                 torch.nn.Linear(2048, 300))  # fmt: skip
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    path = tmp_path / "module.safetensors"
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    target = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                 torch.nn.Linear(2048, 300)).to(DEVICE)  # fmt: skip
    where = {n: p.data_ptr() for n, p in target.state_dict().items()}
    loaded = load_file(path, device=str(DEVICE), into=module_destinations(target),
                       settings=settings)  # fmt: skip
    assert_same_bytes(dict(target.state_dict()), st_load(str(path)))
    assert {n: p.data_ptr() for n, p in target.state_dict().items()} == where  # in place
    assert loaded.report.tensors == len(where)


def write_sharded(folder: Path, shards: int = 4) -> dict[str, torch.Tensor]:
    """The checkpoint as ``save_pretrained`` shards it: ``model-0000i-of-0000n`` files, the
    index, a config."""
    import json

    from huggingface_hub import split_torch_state_dict_into_shards

    state = checkpoint(seed=1)
    total = sum(t.nbytes for t in state.values())
    split = split_torch_state_dict_into_shards(state, max_shard_size=total // shards + 1)
    folder.mkdir(parents=True)
    for name, tensors in split.filename_to_tensors.items():
        save_file({n: state[n] for n in tensors}, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": split.tensor_to_filename}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text('{"model_type": "test"}')
    return state


@pytest.mark.skipif(
    not hasattr(WeightLoader, "load_version"),
    reason="WeightLoader.load_version (multi-file versions) is not there yet",
)
def test_a_sharded_version_lands_on_the_device_whole(
    settings: Settings, copies: list[Any], record_property: Record
) -> None:
    folder = settings.data_dir / "objects" / "sharded" / "1"
    want = write_sharded(folder)
    assert len(list(folder.glob("*.safetensors"))) >= 3
    uri = folder.as_uri() + "/"
    facts = validation.inspect_artifact(uri, settings, None)  # what registration records
    spec = VersionSpec(model="sharded", version="1", artifact_uri=uri, sha256=facts.sha256,
                       files=facts.files, engine="torch")  # fmt: skip
    loader = WeightLoader(settings)
    miss = loader.load_version(spec, device=str(DEVICE))
    assert miss.report.cache == "miss" and miss.report.sha256 == spec.sha256
    assert_same_bytes(miss.tensors, want)
    assert all(on_device(t) for t in miss.tensors.values())
    assert_side_streams(copies)
    assert miss.pin is not None
    miss.pin.release()
    hit = loader.load_version(spec, device=str(DEVICE))
    assert hit.report.cache == "hit"
    assert_same_bytes(hit.tensors, want)
    record_property("sharded_miss_s", round(miss.report.seconds, 4))
    record_property("sharded_hit_s", round(hit.report.seconds, 4))
