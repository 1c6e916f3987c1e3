"""The warm tier of a torch module on an accelerator: its weights in pinned host memory, its
device memory given back.

``demote(module)`` copies every parameter and buffer into a host tensor of its own — pinned
(page-locked) where the process can pin, so the copies run by DMA, asynchronously — waits
for the copies, points the module's tensors at the host copies and returns the freed device
memory to the driver (``torch.cuda.empty_cache``), so that another process can use it.
``promote(module, device)`` copies them back (non-blocking from pinned memory, one
synchronisation at the end). The host tensors are allocated once per module and reused by
every later demotion: pinning gigabytes costs about as much as copying them, and the warm
tier exists to make the next promotion fast. They live as long as the module does.

Where nothing can be pinned (no CUDA: ``pin_memory`` raises) the host tensors are ordinary
pageable memory and the copies synchronous: the same result, slower. A tensor already in
host memory is copied too (the bookkeeping does not depend on where the module is), which
is why an engine on the CPU does not call this at all: there, warm is hot.

Tensors are the module's own parameter and buffer objects (their ``.data`` is swapped, as
``Module.to`` did), so a weight tied to another (one object under two names) stays tied.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ember.logs import get_logger

if TYPE_CHECKING:
    import torch

log = get_logger(__name__)

_HOST: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
"""Each module's host copies by tensor name: made by its first demotion, dropped with it."""


def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer once (a tied one under its first name)."""
    seen: set[int] = set()
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def _host_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped like ``tensor``: pinned where this process can pin."""
    import torch

    try:
        return torch.empty_like(tensor, device="cpu", pin_memory=True)
    except RuntimeError:  # no pinned-memory allocator (no CUDA): pageable memory
        return torch.empty_like(tensor, device="cpu")


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def demote(module: torch.nn.Module) -> int:
    """Move ``module``'s weights to (pinned) host memory and give its device memory back.
    Returns the bytes copied."""
    import torch

    host = _HOST.setdefault(module, {})
    moved: list[tuple[torch.Tensor, torch.Tensor]] = []
    devices: set[torch.device] = set()
    for name, tensor in _tensors(module):
        copy = host.get(name)
        if copy is None or copy.shape != tensor.shape or copy.dtype != tensor.dtype:
            copy = host[name] = _host_like(tensor)
        copy.copy_(tensor.detach(), non_blocking=copy.is_pinned())
        moved.append((tensor, copy))
        devices.add(tensor.device)
    for device in devices:  # the copies are done before the device memory goes
        _synchronize(device)
    for tensor, copy in moved:
        tensor.data = copy
    if any(d.type == "cuda" for d in devices):
        torch.cuda.empty_cache()
    pinned = all(copy.is_pinned() for _, copy in moved)
    copied = sum(copy.numel() * copy.element_size() for _, copy in moved)
    log.info("weights demoted to host memory", bytes=copied, pinned=pinned)
    return copied


def promote(module: torch.nn.Module, device: str) -> int:
    """Copy ``module``'s weights back to ``device`` (from a demotion's host copies).
    Returns the bytes copied."""
    import torch

    target = torch.device(device)
    copied = 0
    for _name, tensor in _tensors(module):
        on_device = tensor.detach().to(target, non_blocking=tensor.is_pinned(), copy=True)
        tensor.data = on_device  # the host copy stays, for the next demotion
        copied += on_device.numel() * on_device.element_size()
    _synchronize(target)
    return copied


def host_copies(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The host copies ``module``'s demotions use (empty before the first one)."""
    return dict(_HOST.get(module, {}))
