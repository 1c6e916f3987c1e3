"""The passthrough relay (OpenAI routes) against a real, scripted replica on loopback: an
event stream is logged whole when its last event went out, however the relay was stopped."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ember.domain.spec import Priority, VersionSpec
from ember.pools.backends.base import ReplicaHandle
from ember.pools.controller import PoolsController
from ember.pools.inventory import ManagedReplica
from ember.registry.schemas import PoolPolicy
from ember.serving.admission import Admission
from ember.serving.gateway import Gateway
from ember.serving.passthrough import Passthrough
from ember.serving.predlog import PredictionLog
from ember.serving.router import Route
from ember.serving.routing import DeploymentView
from tests.gateway.test_hop import read_request, serve
from tests.pools.test_controller_autoscale import FakeBackend

EVENT = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


class Recorded(PredictionLog):
    """The prediction log's records, kept in memory."""

    def __init__(self) -> None:
        super().__init__(None)
        self.kept: list[dict[str, Any]] = []

    def record(self, record: dict[str, Any]) -> None:
        self.kept.append(record)


def sse_replica(events: list[bytes]) -> Any:
    """Answers with ``events`` as a chunked event stream, then holds the connection open
    (the replica's end of the stream never comes while the test runs)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(30)

    return handler


async def relay_until_cancelled(url: str, stop_after: bytes) -> dict[str, Any]:
    """Relay one stream as the OpenAI route does and cancel the relay (what the server
    does when the client leaves) once ``stop_after`` went out; the record it logged."""
    controller = PoolsController(None, FakeBackend(), standby_pool=0)  # type: ignore[arg-type]
    view = DeploymentView(
        1,
        "llm",
        "llm",
        {"1": 100},
        PoolPolicy(),
        {
            "1": VersionSpec(
                model="llm", version="1", artifact_uri="file:///llm", sha256="", engine="vllm"
            )
        },
        [],
    )
    replica = ManagedReplica(ReplicaHandle("r1", url), (1, "llm"), "llm", "1", state="ready")
    replica.route = Route("r1", url, "1")
    controller.replicas["r1"] = replica
    controller.publish()
    log = Recorded()
    gateway = Gateway(controller, Admission(1e9, 1e9), 0.1, predictions=log)
    try:
        opened = await Passthrough(gateway).open(
            view, "t", "/v1/chat/completions", lambda version: {"stream": True},
            priority=Priority.online, timeout_ms=20_000, input_size=1, output_size=1,
        )  # fmt: skip
        sent = b""
        reached = asyncio.Event()

        async def client() -> None:
            nonlocal sent
            async for chunk in opened.stream():
                sent += chunk
                if stop_after in sent:
                    reached.set()

        relay = asyncio.create_task(client())
        await asyncio.wait_for(reached.wait(), 10)
        await asyncio.sleep(0.05)  # the relay is back awaiting the replica
        relay.cancel()  # awaiting the replica's next bytes, as when the client leaves
        with pytest.raises(asyncio.CancelledError):
            await relay
        await opened.close()
        assert len(log.kept) == 1
        return log.kept[0]
    finally:
        await gateway.http.aclose()


def test_a_stream_whose_last_event_went_out_is_whole_however_it_was_stopped() -> None:
    async def scenario(url: str) -> None:
        record = await relay_until_cancelled(url, DONE)
        assert (record["status"], record.get("error")) == (200, None)

    asyncio.run(serve(sse_replica([EVENT, DONE]), scenario))


def test_a_stream_cut_before_its_last_event_is_incomplete() -> None:
    async def scenario(url: str) -> None:
        record = await relay_until_cancelled(url, EVENT)
        assert (record["status"], record["error"]) == (502, "incomplete answer")

    asyncio.run(serve(sse_replica([EVENT]), scenario))
