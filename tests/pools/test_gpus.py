"""The local backend's GPU inventory and allocation (``ember.pools.backends.gpus``): what
``EMBER_GPUS`` says, what NVML finds through the API's ``CUDA_VISIBLE_DEVICES``, and a pool
that never gives one device twice and queues first come first served."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ember.config import Settings
from ember.domain.gpus import Gpu
from ember.pools.backends import gpus as g
from ember.pools.backends.gpus import GpuPool, Inventory


def test_ember_gpus_states_the_inventory_or_leaves_it_to_nvml() -> None:
    assert g.parse_setting("auto") is None and g.parse_setting(" AUTO ") is None
    assert g.parse_setting("none") == () and g.parse_setting("") == ()
    assert [d.id for d in g.parse_setting("0, 1,GPU-5d3b9c1e") or ()] == ["0", "1", "GPU-5d3b9c1e"]
    described = g.parse_setting('[{"id": "MIG-4f1c", "name": "A100 1g.10gb", "memory_bytes": 10}]')
    assert described == (Gpu("MIG-4f1c", "A100 1g.10gb", 10),)
    assert Settings(gpus="0,1").gpus == "0,1"


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("0,0", "twice"),
        ("0,,1", "not a device index"),
        ("gpu0", "not a device index"),
        ("0;rm -rf /", "not a device index"),
        ("[{", "not a JSON list"),
        ('{"id": "0"}', "not a device index"),  # not a list: read as ids, refused
        ('[{"id": "0", "extra": 1}]', "each device is"),
        ('[{"id": "0", "memory_bytes": -1}]', "whole number"),
        ('[{"id": "0", "memory_bytes": true}]', "whole number"),
        ('[{"id": "0", "name": 7}]', "name is a string"),
        ('["0"]', "each device is"),
    ],
)
def test_a_bad_ember_gpus_is_refused_with_its_reason(value: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        g.parse_setting(value)
    with pytest.raises(ValidationError, match=says):
        Settings(gpus=value)


MACHINE = [
    Gpu("GPU-aaaa-1111", "NVIDIA L4", 24 * 2**30, 0),
    Gpu("GPU-bbbb-2222", "NVIDIA L4", 24 * 2**30, 1),
    Gpu("MIG-cccc-3333", "NVIDIA A100 1g.10gb", 10 * 2**30, 2),  # GPU 2 is in MIG mode
    Gpu("MIG-cccc-4444", "NVIDIA A100 1g.10gb", 10 * 2**30, 2),
]


@pytest.mark.parametrize(
    ("cuda_visible", "ids"),
    [
        (None, ["GPU-aaaa-1111", "GPU-bbbb-2222", "MIG-cccc-3333", "MIG-cccc-4444"]),
        ("", []),
        ("-1", []),
        ("1,0", ["GPU-bbbb-2222", "GPU-aaaa-1111"]),  # the order it gives
        ("GPU-bbbb", ["GPU-bbbb-2222"]),  # a UUID prefix
        ("MIG-cccc-4444, 0", ["MIG-cccc-4444", "GPU-aaaa-1111"]),
        ("2", ["MIG-cccc-3333", "MIG-cccc-4444"]),  # a GPU in MIG mode: its MIG devices
        ("0,7,1", ["GPU-aaaa-1111"]),  # the list ends at an entry that names nothing
        ("MIG-cccc,1", []),  # an ambiguous prefix names nothing
        ("0,0", ["GPU-aaaa-1111"]),
    ],
)
def test_the_apis_cuda_visible_devices_limits_what_replicas_get(
    cuda_visible: str | None, ids: list[str]
) -> None:
    assert [d.id for d in g.visible(MACHINE, cuda_visible)] == ids


def test_without_a_driver_discovery_finds_no_gpus_and_says_why() -> None:
    try:
        found: list[Gpu] | None = g.nvml_gpus()
    except g.NvmlUnavailable as exc:
        found, why = None, str(exc)
    inventory = g.discover("auto", {})
    if found is None:  # this machine: no NVIDIA driver (the library fails at nvmlInit)
        assert inventory == Inventory((), "nvml", why) and why
        assert inventory.describe() == f"no GPUs (nvml: {why})"
    else:  # a machine with GPUs
        assert inventory == Inventory(tuple(found), "nvml")
    assert g.discover("auto", {"CUDA_VISIBLE_DEVICES": ""}).gpus == ()
    assert g.discover("0,1", {"CUDA_VISIBLE_DEVICES": ""}).gpus == (Gpu("0"), Gpu("1"))


@dataclass
class _Memory:
    total: int


class _FakeNvml(types.ModuleType):
    """NVML as the driver would answer on a host with an L4 and an A100 in MIG mode (two
    MIG devices, one empty slot). Only names the real ``pynvml`` has (checked below)."""

    NVML_DEVICE_MIG_ENABLE = 1

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.open = 0

    def nvmlInit(self) -> None:  # NVML's names
        self.open += 1

    def nvmlShutdown(self) -> None:
        self.open -= 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return ["l4", "a100"][index]

    def nvmlDeviceGetUUID(self, handle: str) -> str | bytes:
        ids = {"l4": "GPU-11", "a100": "GPU-22", "mig0": "MIG-33", "mig2": "MIG-44"}
        return ids[handle].encode() if handle == "mig2" else ids[handle]  # old: bytes

    def nvmlDeviceGetName(self, handle: str) -> str:
        return "NVIDIA L4" if handle == "l4" else "NVIDIA A100 MIG 1g.10gb"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> _Memory:
        return _Memory(24 if handle == "l4" else 10)

    def nvmlDeviceGetMigMode(self, handle: str) -> tuple[int, int]:
        if handle == "l4":
            raise self.NVMLError("Not Supported")
        return (1, 1)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: str) -> int:
        return 3

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: str, slot: int) -> str:
        if slot == 1:
            raise self.NVMLError("Not Found")
        return f"mig{slot}"


def test_nvml_lists_gpus_and_mig_devices_through_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pynvml  # the real bindings: the fake uses no name they lack

    fake = _FakeNvml()
    used = [n for n in dir(_FakeNvml) if n.startswith(("nvml", "NVML"))]
    assert used and all(hasattr(pynvml, n) for n in used)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    found = g.discover("auto", {})
    mig = "NVIDIA A100 MIG 1g.10gb"
    assert found == Inventory(
        (Gpu("GPU-11", "NVIDIA L4", 24, 0), Gpu("MIG-33", mig, 10, 1), Gpu("MIG-44", mig, 10, 1)),
        "nvml",
    )
    assert [d.id for d in g.discover("auto", {"CUDA_VISIBLE_DEVICES": "MIG-44,0"}).gpus] == [
        "MIG-44",
        "GPU-11",
    ]
    assert fake.open == 0  # shut down every time


def test_the_pool_queues_in_order_and_says_why() -> None:
    pool = GpuPool(Inventory(tuple(Gpu(str(i)) for i in range(4))))
    assert pool.refusal(5) == "the placement asks for 5 GPUs; this host has 4 GPUs (EMBER_GPUS)"
    assert pool.refusal(4) is None
    for replica, n in [("a", 3), ("b", 2), ("c", 1)]:
        pool.ask(replica, n)
    assert pool.admit() == [("a", (Gpu("0"), Gpu("1"), Gpu("2")))]
    assert pool.waiting("a") is None
    assert pool.waiting("b") == "waiting for 2 GPUs, 1 of 4 free"
    # c would fit, but does not overtake b (a large ask is never starved by small ones)
    assert pool.waiting("c") == "waiting for 1 GPU, 1 of 4 free; 1 replica ahead in the queue"
    pool.release("a")
    assert pool.admit() == [("b", (Gpu("0"), Gpu("1"))), ("c", (Gpu("2"),))]
    pool.ask("d", 2)
    pool.release("d")  # stopped while it waited
    assert pool.queue == [] and pool.admit() == []
    none = GpuPool(Inventory((), "nvml", "NVML Shared Library Not Found"))
    assert none.refusal(1) == (
        "the placement asks for 1 GPU; this host has no GPUs (nvml: NVML Shared Library Not Found)"
    )


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(1, 6)), max_size=60),
)
def test_the_pool_never_gives_a_device_twice_and_serves_in_order(
    size: int, steps: list[tuple[bool, int, int]]
) -> None:
    pool = GpuPool(Inventory(tuple(Gpu(str(i)) for i in range(size))))
    asked: dict[str, int] = {}
    order: list[str] = []
    for is_ask, who, n in steps:
        replica = f"r{who}"
        if is_ask and replica not in asked and pool.refusal(n) is None:
            pool.ask(replica, n)
            asked[replica], order = n, [*order, replica]
        elif not is_ask:
            pool.release(replica)
            asked.pop(replica, None)
            order = [r for r in order if r != replica]
        pool.admit()
        held = [d for devices in pool.held.values() for d in devices]
        assert len(held) == len(set(held)) <= size  # never oversubscribed
        assert all(len(pool.held[r]) == asked[r] for r in pool.held)  # exactly what it asked
        waiting = [r for r in order if r not in pool.held]
        assert [r for r, _ in pool.queue] == waiting
        if waiting:  # first come, first served: none asked after the first waiting one holds
            first = order.index(waiting[0])
            assert all(order.index(r) < first for r in pool.held)
            assert asked[waiting[0]] > len(pool.free)  # which waits only for lack of devices
