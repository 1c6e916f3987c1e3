"""The GPUs of this machine, for the local replica backend: what there is and who holds it.

What there is (``discover``) comes from ``EMBER_GPUS``: ``auto`` asks NVML (the driver's
management library, through ``nvidia-ml-py``; no CUDA context, no torch — the API process
stays light) for every NVIDIA GPU, and for the MIG devices of a GPU in MIG mode instead of
the GPU itself, then keeps those the API's own ``CUDA_VISIBLE_DEVICES`` lets it see
(indices in NVML's order, which is PCI bus order; ``GPU-``/``MIG-`` UUIDs or their
prefixes; an empty value: none; CUDA's rule that the list ends at its first invalid entry).
A machine without the driver or the library has no GPUs, and says why (``Inventory.note``):
discovery never raises. ``none`` or an explicit list states the inventory instead (tests,
or an operator who hands the platform some devices only), and NVML is not asked.

Who holds what (``GpuPool``): each device whole, to one replica at a time; a replica that
asks for more than is free waits in arrival order (none overtakes another, so one that asks
for many devices is never starved by ones that ask for few), and is told why it waits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ember.domain.gpus import Gpu, parse_setting

CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[Gpu, ...] = ()
    source: str = "EMBER_GPUS"
    """``nvml`` (discovered) or ``EMBER_GPUS`` (stated)."""
    note: str = ""
    """Why NVML found none (no driver, no library), for the messages that need a GPU."""

    def describe(self) -> str:
        """``2 GPUs (nvml)``, ``no GPUs (nvml: NVML Shared Library Not Found)``."""
        count = f"{len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''}" if self.gpus else ""
        where = f"{self.source}: {self.note}" if self.note else self.source
        return f"{count or 'no GPUs'} ({where})"


def discover(setting: str, environ: Mapping[str, str]) -> Inventory:
    """This machine's GPUs as ``EMBER_GPUS`` (``setting``) says: stated, or NVML's seen
    through ``environ``'s ``CUDA_VISIBLE_DEVICES``. Never raises for a missing driver."""
    stated = parse_setting(setting)
    if stated is not None:
        return Inventory(stated, "EMBER_GPUS")
    try:
        found = nvml_gpus()
    except NvmlUnavailable as exc:
        return Inventory((), "nvml", str(exc))
    return Inventory(tuple(visible(found, environ.get(CUDA_VISIBLE))), "nvml")


class NvmlUnavailable(Exception):
    """No NVML here: the library, the driver or a device could not be read."""


def nvml_gpus() -> list[Gpu]:
    """Every GPU NVML lists, a GPU in MIG mode as its MIG devices."""
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable("nvidia-ml-py is not installed") from None
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError) as exc:
        raise NvmlUnavailable(str(exc) or type(exc).__name__) from None
    try:
        found: list[Gpu] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            migs = _mig_devices(pynvml, handle, index)
            found += migs or [_gpu(pynvml, handle, index)]
        return found
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(str(exc)) from None
    finally:
        pynvml.nvmlShutdown()


def _gpu(nvml: Any, handle: Any, index: int) -> Gpu:
    return Gpu(
        _text(nvml.nvmlDeviceGetUUID(handle)),
        _text(nvml.nvmlDeviceGetName(handle)),
        int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
        index,
    )


def _mig_devices(nvml: Any, handle: Any, index: int) -> list[Gpu]:
    """A GPU in MIG mode: its MIG devices (what CUDA can be given), else none."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # not MIG-capable
        return []
    if current != nvml.NVML_DEVICE_MIG_ENABLE:
        return []
    migs = []
    for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nvml.NVMLError:  # an empty slot
            continue
        migs.append(_gpu(nvml, mig, index))
    return migs


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def visible(gpus: Sequence[Gpu], cuda_visible: str | None) -> list[Gpu]:
    """The devices of ``gpus`` that ``CUDA_VISIBLE_DEVICES=cuda_visible`` lets a process
    see, in its order: unset, all; an entry is an NVML index (a GPU in MIG mode: its MIG
    devices) or a UUID prefix naming one device; the list ends at its first entry that
    names nothing (as CUDA reads it: ``""`` or ``-1`` hides every device)."""
    if cuda_visible is None:
        return list(gpus)
    seen: list[Gpu] = []
    for entry in (e.strip() for e in cuda_visible.split(",")):
        if entry.isdigit():
            named = [g for g in gpus if g.index == int(entry)]
        else:
            named = [g for g in gpus if entry and g.id.startswith(entry)][:2]
            named = named if len(named) == 1 else []  # an ambiguous prefix names nothing
        if not named:
            break
        seen += [g for g in named if g not in seen]
    return seen


def plural(n: int) -> str:
    return f"{n} GPU{'s' if n != 1 else ''}"


@dataclass
class GpuPool:
    """Whole devices held by replicas, never one device by two; the rest queue in arrival
    order. Not thread-safe by itself: its owner calls it under one lock."""

    inventory: Inventory
    held: dict[str, tuple[Gpu, ...]] = field(default_factory=dict)
    queue: list[tuple[str, int]] = field(default_factory=list)
    """(replica id, devices asked for), first come first served."""

    @property
    def free(self) -> list[Gpu]:
        taken = {g for gpus in self.held.values() for g in gpus}
        return [g for g in self.inventory.gpus if g not in taken]

    def refusal(self, n: int) -> str | None:
        """Why ``n`` devices can never be had here (more than the machine has), or None."""
        if n <= len(self.inventory.gpus):
            return None
        return f"the placement asks for {plural(n)}; this host has {self.inventory.describe()}"

    def ask(self, replica_id: str, n: int) -> None:
        """Queue ``replica_id`` for ``n`` devices (``admit`` hands them out)."""
        self.queue.append((replica_id, n))

    def admit(self) -> list[tuple[str, tuple[Gpu, ...]]]:
        """Give the first queued replicas their devices while the first one fits."""
        granted = []
        while self.queue and self.queue[0][1] <= len(self.free):
            replica_id, n = self.queue.pop(0)
            self.held[replica_id] = tuple(self.free[:n])
            granted.append((replica_id, self.held[replica_id]))
        return granted

    def release(self, replica_id: str) -> None:
        """``replica_id``'s devices are free again (its process is gone), or it stops
        waiting for them."""
        self.held.pop(replica_id, None)
        self.queue = [(r, n) for r, n in self.queue if r != replica_id]

    def waiting(self, replica_id: str) -> str | None:
        """Why ``replica_id`` waits (``waiting for 2 GPUs, 1 of 4 free``), None if it does
        not."""
        for ahead, (queued, n) in enumerate(self.queue):
            if queued == replica_id:
                total, free = len(self.inventory.gpus), len(self.free)
                reason = f"waiting for {plural(n)}, {free} of {total} free"
                if ahead:
                    reason += f"; {ahead} replica{'s' if ahead != 1 else ''} ahead in the queue"
                return reason
        return None
