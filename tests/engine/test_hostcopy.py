"""The warm tier's host copies (``ember.engine.hostcopy``), on the CPU: the bookkeeping is
the same as on a GPU (copies made once and reused, ties kept, buffers too, the module's own
tensor objects), pinning degrades to pageable memory where nothing can be pinned, and an
engine on the CPU does not use it at all. The CUDA side is in ``tests/gpu``."""

from __future__ import annotations

import gc
from typing import Any

import torch
from structlog.testing import capture_logs

from ember.config import Settings
from ember.domain.spec import Tier, VersionSpec
from ember.engine import hostcopy
from ember.engine.torch_engine import TorchEngine


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # one parameter under two names
        self.norm = torch.nn.BatchNorm1d(4)  # buffers: running mean and variance
        self.low = torch.nn.Linear(4, 4).to(torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x)))


def _pointers(module: torch.nn.Module) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in [*module.named_parameters(), *module.named_buffers()]}


def test_demotion_copies_each_tensor_once_into_reused_host_memory() -> None:
    torch.manual_seed(0)
    module = Tied().eval()
    x = torch.tensor([1, 2, 3])
    before, weight = module(x), module.head.weight
    state = {k: v.clone() for k, v in module.state_dict().items()}
    originally = _pointers(module)

    with capture_logs() as logs:
        copied = hostcopy.demote(module)
    host = hostcopy.host_copies(module)
    assert set(host) == {"embed.weight", "norm.weight", "norm.bias", "norm.running_mean",
                         "norm.running_var", "norm.num_batches_tracked",
                         "low.weight", "low.bias"}  # fmt: skip
    assert copied == sum(t.numel() * t.element_size() for t in host.values())
    demoted = _pointers(module)
    assert all(demoted[n] != originally[n] for n in originally)  # into the copies
    assert module.head.weight is weight and module.embed.weight is weight  # still tied
    assert module.low.weight.dtype == torch.float16
    assert all(torch.equal(module.state_dict()[k], v) for k, v in state.items())
    # Nothing can be pinned without CUDA: pageable memory, said in the log line.
    assert not torch.cuda.is_available() and not any(t.is_pinned() for t in host.values())
    (line,) = [entry for entry in logs if entry["event"] == "weights demoted to host memory"]
    assert line["pinned"] is False and line["bytes"] == copied

    assert hostcopy.promote(module, "cpu") == copied
    hot = _pointers(module)
    assert all(hot[n] != demoted[n] for n in hot)  # fresh tensors: the copies stay apart
    assert torch.equal(module(x), before)
    with torch.no_grad():
        module.embed.weight.add_(1.0)  # served hot for a while: the weights change
    hostcopy.demote(module)
    assert _pointers(module) == demoted  # the same host memory, reused
    assert torch.equal(hostcopy.host_copies(module)["embed.weight"], state["embed.weight"] + 1)


def test_the_host_copies_go_with_their_module() -> None:
    module = Tied()
    hostcopy.demote(module)
    assert module in hostcopy._HOST
    held = len(hostcopy._HOST)
    del module
    gc.collect()
    assert len(hostcopy._HOST) == held - 1


def test_an_engine_on_the_cpu_keeps_its_weights_where_they_are(
    mlp_spec: dict[str, Any], data_dir: Any
) -> None:
    engine = TorchEngine(VersionSpec.model_validate(mlp_spec), Settings(data_dir=data_dir))
    engine.load()
    pointers = _pointers(engine.module)
    engine.set_tier(Tier.warm)
    assert engine.tier is Tier.warm and _pointers(engine.module) == pointers
    assert hostcopy.host_copies(engine.module) == {}
    engine.set_tier(Tier.hot)
    assert _pointers(engine.module) == pointers
    engine.set_tier(Tier.standby)
    assert engine.module is None
    engine.close()
