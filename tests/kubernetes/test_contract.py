"""The replica-backend contract, run on both backends: the local one with a real
``ember engine --standby`` process, the Kubernetes one against kmock and the fake
cluster (conftest). Same tests, same assertions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ember.config import Settings
from ember.pools.backends.base import LaunchOptions, ReplicaBackend, ReplicaHandle
from ember.pools.backends.local import LocalProcessBackend
from tests.kubernetes.conftest import wait_for

STARTUP_S = 90.0  # a real standby process imports torch and transformers


@pytest.fixture(params=["local", "kubernetes"])
def backend(request: pytest.FixtureRequest, data_dir: Path) -> Iterator[ReplicaBackend]:
    if request.param == "kubernetes":
        yield request.getfixturevalue("make_backend")()
        return
    local = LocalProcessBackend(Settings(data_dir=data_dir))
    yield local
    local.close()


def _info(handle: ReplicaHandle) -> dict[str, object] | None:
    if not handle.url:
        return None  # not placed yet
    try:
        body: dict[str, object] = httpx.get(
            f"{handle.url}/info", headers=handle.auth, timeout=2
        ).json()
        return body
    except httpx.HTTPError:
        return None


def _answers(handle: ReplicaHandle, url: str) -> bool:
    try:
        httpx.get(f"{url}/info", timeout=1)
        return True
    except httpx.HTTPError:
        return False


def _started(backend: ReplicaBackend) -> ReplicaHandle:
    handle = backend.launch(None, LaunchOptions())
    info = wait_for(lambda: _info(handle), "the standby replica's /info", STARTUP_S)
    assert info["state"] == "standby"
    assert backend.exited(handle) is None
    return handle


def test_a_standby_replica_starts_answers_and_stops(backend: ReplicaBackend) -> None:
    handle = _started(backend)
    url = handle.url
    backend.stop(handle, grace_s=10)
    assert backend.exited(handle) is not None
    wait_for(lambda: not _answers(handle, url), "the stopped replica to stop answering")
    assert all(o.handle.replica_id != handle.replica_id for o in backend.observe())


def test_kill_ends_a_replica_at_once(backend: ReplicaBackend) -> None:
    handle = _started(backend)
    url = handle.url
    backend.kill(handle)
    assert backend.exited(handle) is not None
    wait_for(lambda: not _answers(handle, url), "the killed replica to stop answering")


def test_an_unknown_handle_counts_as_exited(backend: ReplicaBackend) -> None:
    assert backend.exited(ReplicaHandle("never-launched", "")) is not None
