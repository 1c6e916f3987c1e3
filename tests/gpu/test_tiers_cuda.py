"""The warm tier on CUDA (``ember.engine.hostcopy`` through ``ModuleEngine.set_tier``): warm
holds the weights in pinned host memory and gives the device memory back; hot copies them
back (the same pinned buffers every time) and answers as before; standby drops them. The
tier changes' timings are recorded (``tier_*_s``). Skipped without CUDA; the CPU side of
the same code is tested in ``tests/engine/test_hostcopy.py``."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from ember.config import Settings
from ember.domain.spec import Tier, VersionSpec
from ember.engine import hostcopy
from ember.engine.examples.mlp import ENGINE_CONFIG, INPUT_SCHEMA, build_mlp_artifact
from ember.engine.torch_engine import TorchEngine
from tests.gpu.cuda import DEVICE, cuda_only, device_bytes, module_bytes, needs_device, timed

pytestmark = [needs_device, cuda_only]
Record = Callable[[str, object], None]


def test_demotion_frees_the_device_and_reuses_pinned_host_memory(
    record_property: Record,
) -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.GELU(),
                                 torch.nn.Linear(4096, 2048)).to(DEVICE).eval()  # fmt: skip
    x = torch.randn(8, 2048, device=DEVICE)
    with torch.no_grad():
        before = module(x)
    weights = {k: v.cpu() for k, v in module.state_dict().items()}
    size, on_device = module_bytes(module), device_bytes()
    matrices = sum(p.numel() * p.element_size() for p in module.parameters() if p.dim() == 2)
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(DEVICE)
    with timed(record_property, "tier_module_warm_s"):
        hostcopy.demote(module)
    assert on_device - device_bytes() >= size  # the weights left the device
    # and the driver has their memory back (the biases' small blocks share a segment with
    # the input's, which stays)
    assert reserved - torch.cuda.memory_reserved(DEVICE) >= matrices
    host = hostcopy.host_copies(module)
    assert all(t.is_pinned() and t.device.type == "cpu" for t in host.values())
    assert all(p.device.type == "cpu" for p in module.parameters())
    pinned = {name: t.data_ptr() for name, t in host.items()}
    for cycle in range(2):
        with timed(record_property, f"tier_module_hot_{cycle}_s"):
            hostcopy.promote(module, str(DEVICE))
        assert all(p.device.type == "cuda" for p in module.parameters())
        assert all(torch.equal(v.cpu(), weights[k]) for k, v in module.state_dict().items())
        with torch.no_grad():
            torch.testing.assert_close(module(x), before)
        hostcopy.demote(module)
        assert {n: t.data_ptr() for n, t in hostcopy.host_copies(module).items()} == pinned


def test_a_torch_engine_on_cuda_goes_warm_hot_and_standby(
    tmp_path: Path, record_property: Record
) -> None:
    data = tmp_path / "data"
    path = build_mlp_artifact(data / "objects" / "mlp" / "1" / "model.safetensors")
    spec = VersionSpec(model="mlp", version="1", artifact_uri=path.as_uri(),
                       sha256=hashlib.sha256(path.read_bytes()).hexdigest(), engine="torch",
                       engine_config=ENGINE_CONFIG, input_schema=INPUT_SCHEMA)  # fmt: skip
    engine = TorchEngine(spec, Settings(data_dir=data), str(DEVICE))
    engine.load()
    x = torch.randn(4, 256, device=DEVICE)
    with torch.no_grad():
        hot = engine.module(x)
    loaded = device_bytes()
    with timed(record_property, "tier_engine_warm_s"):
        engine.set_tier(Tier.warm)
    assert engine.tier is Tier.warm
    assert all(p.device.type == "cpu" and p.is_pinned() for p in engine.module.parameters())
    assert loaded - device_bytes() >= module_bytes(engine.module)
    with timed(record_property, "tier_engine_hot_s"):
        engine.set_tier(Tier.hot)
    assert all(p.device.type == "cuda" for p in engine.module.parameters())
    with torch.no_grad():
        torch.testing.assert_close(engine.module(x), hot)
    engine.set_tier(Tier.warm)
    warm = weakref.ref(engine.module)
    assert hostcopy.host_copies(engine.module)
    with timed(record_property, "tier_engine_standby_s"):
        engine.set_tier(Tier.standby)  # from warm: the pinned copies go with the module
    assert engine.module is None and warm() is None
    with timed(record_property, "tier_engine_standby_to_hot_s"):
        engine.set_tier(Tier.hot)
    with torch.no_grad():
        torch.testing.assert_close(engine.module(x), hot)
    engine.close()
