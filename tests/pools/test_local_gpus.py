"""GPUs on one machine: the local backend gives each replica the whole devices its placement
asks for (``CUDA_VISIBLE_DEVICES`` of its own, ``--device cuda``), never one device twice,
queues what does not fit (and says so through the API) and starts it when devices free up.

This machine has no GPU, so the inventory is stated (``EMBER_GPUS``) and a GPU replica's
process is a stand-in: either one that only waits (the backend's own tests read its argv and
environment from ``/proc``), or — through the live API — the real ``ember engine`` started
by a wrapper that records the arguments it was given and runs them with ``--device cpu``.
No replica is started with ``--device cuda`` here.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ember.config import Settings
from ember.domain.spec import VersionSpec
from ember.pools.backends.base import LaunchOptions, ReplicaHandle
from ember.pools.backends.local import LocalProcessBackend, gpus_asked
from ember.registry.schemas import Placement
from tests import services
from tests.gateway.conftest import Live, deploy, live_api
from tests.pools.test_gpus import MACHINE
from tests.services import process_environ

SPEC = VersionSpec(
    model="m",
    version="1",
    artifact_uri="file:///nowhere/model.safetensors",
    sha256="",
    engine="torch",
)
CPU = LaunchOptions(tenant_id=1, deployment="m")


def gpus(n: int) -> LaunchOptions:
    return LaunchOptions(
        tenant_id=1, deployment="m", placement=Placement(accelerator="nvidia-l4", gpus=n)
    )


class WaitingBackend(LocalProcessBackend):
    """Replicas are processes that wait to be stopped, with the argv and environment the
    backend gave them."""

    program: Path

    def executable(self, spec: VersionSpec | None) -> Path:
        return self.program


@pytest.fixture
def make_backend(data_dir: Path, tmp_path: Path) -> Iterator[Any]:
    program = tmp_path / "waits"
    program.write_text(f"#!{sys.executable}\nimport time\nwhile True:\n    time.sleep(1)\n")
    program.chmod(0o755)
    made: list[LocalProcessBackend] = []

    def make(**settings: Any) -> WaitingBackend:
        backend = WaitingBackend(Settings(data_dir=data_dir, **settings))
        backend.program = program
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def launched(handle: ReplicaHandle) -> tuple[list[str], dict[str, str]]:
    """The argv (after the interpreter and the program) and environment of the replica."""
    assert handle.pid is not None
    cmdline = Path(f"/proc/{handle.pid}/cmdline")
    services.wait_until(lambda: b"engine" in cmdline.read_bytes(), 30, "the replica's exec")
    argv = cmdline.read_bytes().decode().split("\0")[:-1]
    return argv[argv.index("engine") :], process_environ(handle.pid)


def devices(handle: ReplicaHandle) -> list[str]:
    argv, env = launched(handle)
    assert argv[argv.index("--device") + 1] == "cuda"
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(handle.extra["gpus"])
    return env["CUDA_VISIBLE_DEVICES"].split(",")


def test_placement_asks_for_gpus_only_with_an_accelerator() -> None:
    assert gpus_asked(Placement(accelerator="nvidia-l4", gpus=2)) == 2
    assert gpus_asked(Placement(accelerator="nvidia-l4", gpus=0)) == 0
    assert gpus_asked(Placement(gpus=2)) == 0  # no accelerator: a CPU placement
    assert gpus_asked(None) == 0


def test_replicas_get_whole_devices_and_wait_for_them_in_order(
    make_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")  # the API's own: no replica's
    backend = make_backend(gpus="0,1,2")
    a = backend.launch(SPEC, gpus(2))
    b = backend.launch(SPEC, gpus(2))
    c = backend.launch(SPEC, gpus(1))  # would fit, but does not overtake b
    cpu = backend.launch(SPEC, CPU)
    standby = backend.launch(None, LaunchOptions())
    assert devices(a) == ["0", "1"]
    behind = "waiting for 1 GPU, 1 of 3 free; 1 replica ahead in the queue"
    for held_back, why in [(b, "waiting for 2 GPUs, 1 of 3 free"), (c, behind)]:
        assert backend.waiting(held_back) == why
        assert backend.exited(held_back) is None  # waiting, not gone
        assert held_back.pid is None and held_back.url == ""
    for on_cpu in (cpu, standby):  # started at once, seeing no device
        argv, env = launched(on_cpu)
        assert "--device" not in argv and env["CUDA_VISIBLE_DEVICES"] == ""
        assert backend.waiting(on_cpu) is None

    backend.stop(a)  # its devices are free once its process is gone: b, then c, start
    assert backend.waiting(b) is None and backend.waiting(c) is None
    assert sorted(devices(b) + devices(c)) == ["0", "1", "2"]
    assert backend.exited(b) is None and backend.exited(c) is None

    d = backend.launch(SPEC, gpus(1))
    assert backend.waiting(d) == "waiting for 1 GPU, 0 of 3 free"
    assert c.pid is not None
    held_by_c = devices(c)
    os.kill(c.pid, signal.SIGKILL)  # a replica that dies on its own frees its device too
    services.wait_until(lambda: backend.exited(c) is not None, 30, "c's exit")
    assert backend.waiting(d) is None and devices(d) == held_by_c
    assert not set(devices(d)) & set(devices(b))

    e = backend.launch(SPEC, gpus(1))
    backend.stop(e)  # stopped while it waited: it never starts, nothing is held for it
    assert e.pid is None and backend.waiting(e) is None and e.replica_id not in backend.gpus.held
    assert backend.gpus.queue == []


def test_more_gpus_than_the_host_has_is_refused_with_the_reason(make_backend: Any) -> None:
    backend = make_backend(gpus="0,1")
    too_many = backend.launch(SPEC, gpus(3))
    assert backend.exited(too_many) == 1 and too_many.pid is None
    assert backend.exit_reason(too_many) == (
        "the placement asks for 3 GPUs; this host has 2 GPUs (EMBER_GPUS)"
    )
    bare = make_backend(gpus="none")
    cpu_only = bare.launch(SPEC, gpus(1))
    assert bare.exited(cpu_only) == 1
    assert bare.exit_reason(cpu_only) == (
        "the placement asks for 1 GPU; this host has no GPUs (EMBER_GPUS)"
    )
    bare.kill(cpu_only)  # the controller's _fail: forgotten
    assert bare.exit_reason(cpu_only) is None


def test_a_gpu_version_never_takes_a_standby_process(make_backend: Any) -> None:
    backend = make_backend(gpus="0")
    standby = ReplicaHandle("s", "http://127.0.0.1:1")
    assert backend.standby_can_take(standby, SPEC, CPU)
    assert not backend.standby_can_take(standby, SPEC, gpus(1))
    zero = LaunchOptions(placement=Placement(accelerator="nvidia-l4", gpus=0))
    assert backend.standby_can_take(standby, SPEC, zero)


def test_named_devices_reach_the_replica_as_named(make_backend: Any) -> None:
    ids = [d.id for d in MACHINE[1:3]]  # a GPU UUID and a MIG device's
    backend = make_backend(gpus=json.dumps([{"id": i, "name": "x"} for i in ids]))
    assert devices(backend.launch(SPEC, gpus(2))) == ids


WRAPPER = """#!{python}
import json, os, sys
args = sys.argv[1:]
os.environ["STANDIN_ARGV"] = json.dumps(args)  # what the backend asked for
if "--device" in args:  # no GPU on this machine: the same replica, on the CPU
    args[args.index("--device") + 1] = "cpu"
os.execv({ember!r}, [{ember!r}, *args])
"""


def _argv(replica: dict[str, Any]) -> list[str]:
    return list(json.loads(process_environ(replica["pid"])["STANDIN_ARGV"]))


def _metric(live: Live, name: str, **labels: str) -> float:
    text = live.client.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_through_the_api_a_replica_queues_for_gpus_and_starts_when_they_free(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapper = tmp_path / "ember-wrapper"
    ember = str(Path(sys.executable).with_name("ember"))
    wrapper.write_text(WRAPPER.format(python=sys.executable, ember=ember))
    wrapper.chmod(0o755)
    monkeypatch.setattr(LocalProcessBackend, "executable", lambda self, spec: wrapper)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the API's own: reaches no replica
    l4 = {"accelerator": "nvidia-l4"}
    with live_api(data_dir, standby_replicas=1, gpus="0,1") as live:

        def standby_ready() -> bool:
            # at least one: the pool may have grown to cover the asks it saw
            return _metric(live, "ember_replicas", deployment="(standby)", state="standby") >= 1

        for model in ("cpu", "big", "small"):
            live.register(model, "1")
        live.wait(standby_ready, "a standby process")
        # A CPU deployment takes the standby process; it sees no device.
        deploy(live, "cpu", max_replicas=1)
        (cpu,) = live.ready("cpu")
        assert [e["event"] for e in live.events("cpu")][:1] == ["assigned"]
        assert "--device" not in _argv(cpu)
        assert process_environ(cpu["pid"])["CUDA_VISIBLE_DEVICES"] == ""
        live.wait(standby_ready, "a standby process again")
        # Two GPUs for "big": a process of its own (not the standby), both devices.
        deploy(live, "big", max_replicas=1, placement={**l4, "gpus": 2})
        (big,) = live.ready("big")
        assert [e["event"] for e in live.events("big")][:1] == ["starting"]
        argv = _argv(big)
        assert argv[argv.index("--device") + 1] == "cuda" and "--standby" not in argv
        assert process_environ(big["pid"])["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert live.predict("big").status_code == 200
        # "small" asks for one: none is free, so its replica waits, not started.
        created = live.client.post("/v1/deployments", json={
            "model": "small", "version": "1", "max_replicas": 1, "placement": {**l4, "gpus": 1},
        })  # fmt: skip
        assert created.status_code == 201, created.text
        live.wait(lambda: [r["state"] for r in live.replicas("small")] == ["queued"], "queued")
        (queued,) = live.replicas("small")
        assert queued["reason"] == "waiting for 1 GPU, 0 of 2 free" and queued["pid"] is None
        assert [e["reason"] for e in live.events("small") if e["event"] == "queued"] == [
            queued["reason"]
        ]
        live.wait(  # the metrics follow the controller's next pass
            lambda: _metric(live, "ember_replicas", deployment="small", state="queued") == 1,
            "the queued replica in the metrics",
            30,
        )
        # A placement that can never fit here fails with the reason, and stays failed.
        created = live.client.post("/v1/deployments", json={
            "model": "cpu", "name": "huge", "version": "1", "max_replicas": 1,
            "placement": {**l4, "gpus": 3},
        })  # fmt: skip
        assert created.status_code == 201, created.text
        live.wait(lambda: len([e for e in live.events("huge") if e["event"] == "failed"]) == 3,
                  "three refusals")  # fmt: skip
        reasons = {e["reason"] for e in live.events("huge") if e["event"] == "failed"}
        assert reasons == {"the placement asks for 3 GPUs; this host has 2 GPUs (EMBER_GPUS)"}
        # "big" goes: its devices free once its process is gone, and "small" starts on one.
        assert live.client.delete("/v1/deployments/big").status_code == 204
        live.wait(lambda: len(live.ready("small")) == 1, "small's replica ready")
        (small,) = live.ready("small")
        assert process_environ(small["pid"])["CUDA_VISIBLE_DEVICES"] == "0"
        assert not Path(f"/proc/{big['pid']}").exists()  # stopped and reaped
        assert "dequeued" in [e["event"] for e in live.events("small")]
        assert live.predict("small").status_code == 200
