"""The gateway's lean replica client against a real (scripted) HTTP server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from ember.serving.hop import ReplicaClient, ReplicaUnreachable
from tests.services import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await reader.readexactly(length)


def answer(body: bytes, *extra: bytes) -> bytes:
    head = [b"HTTP/1.1 200 OK", b"content-type: application/json",
            b"content-length: " + str(len(body)).encode(), *extra]  # fmt: skip
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def serve(handler: Handler, scenario: Callable[[str], Awaitable[None]]) -> None:
    port = free_port()
    server = await asyncio.start_server(handler, "127.0.0.1", port)
    try:
        await scenario(f"http://127.0.0.1:{port}")
    finally:
        server.close()


def test_keeps_one_connection_warm_and_sends_the_request_as_given() -> None:
    seen: list[tuple[bytes, bytes]] = []
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                head, body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            seen.append((head, body))
            writer.write(answer(b'{"n": %d}' % len(seen), b"x-ember-queue-ms: 1.5"))
            await writer.drain()

    async def scenario(url: str) -> None:
        client = ReplicaClient()
        for i in range(3):
            got = await client.post(
                url, "/infer", b'{"i": %d}' % i, {"X-Ember-Priority": "online"}, 5
            )
            assert got.status_code == 200 and got.content == b'{"n": %d}' % (i + 1)
            assert got.headers["x-ember-queue-ms"] == "1.5"
        await client.close()

    asyncio.run(serve(handler, scenario))
    assert connections == 1
    head, body = seen[2]
    assert head.startswith(b"POST /infer HTTP/1.1\r\n") and body == b'{"i": 2}'
    assert b"X-Ember-Priority: online\r\n" in head and b"Content-Type: application/json" in head


def test_chunked_answers_and_connection_close() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n"
                     b"retry-after: 2\r\nconnection: close\r\n\r\n")  # fmt: skip
        for piece in (b'{"title":', b' "busy"}'):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def scenario(url: str) -> None:
        client = ReplicaClient()
        got = await client.post(url, "/infer", b"{}", {}, 5)
        assert got.status_code == 503 and got.content == b'{"title": "busy"}'
        assert got.headers["retry-after"] == "2"
        assert not any(client._idle.values())  # "connection: close" is not kept
        await client.close()

    asyncio.run(serve(handler, scenario))


def test_a_connection_the_replica_closed_while_idle_is_replaced_transparently() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"{}"))
        await writer.drain()
        writer.close()  # keep-alive timer fired: closed without "connection: close"

    async def scenario(url: str) -> None:
        client = ReplicaClient()
        for _ in range(3):
            assert (await client.post(url, "/infer", b"{}", {}, 5)).status_code == 200
            await asyncio.sleep(0.05)
        await client.close()

    asyncio.run(serve(handler, scenario))


def test_the_keep_alive_race_is_retried_once_on_a_fresh_connection() -> None:
    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await read_request(reader)
        served += 1
        writer.write(answer(b'{"served": %d}' % served))
        await writer.drain()
        await read_request(reader)  # the reused connection's request: closed unanswered
        writer.close()

    async def scenario(url: str) -> None:
        client = ReplicaClient()
        assert (await client.post(url, "/infer", b"{}", {}, 5)).content == b'{"served": 1}'
        assert (await client.post(url, "/infer", b"{}", {}, 5)).content == b'{"served": 2}'
        await client.close()

    asyncio.run(serve(handler, scenario))


def test_failures_are_typed() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{")
        await writer.drain()
        writer.close()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async def refused() -> None:
        with pytest.raises(ReplicaUnreachable):
            await ReplicaClient().post(f"http://127.0.0.1:{free_port()}", "/infer", b"{}", {}, 5)

    async def expect(exc: type[BaseException]) -> Callable[[str], Awaitable[None]]:
        async def scenario(url: str) -> None:
            client = ReplicaClient()
            with pytest.raises(exc):
                await client.post(url, "/infer", b"{}", {}, 0.3)
            assert not any(client._idle.values())  # a failed exchange is never reused
            await client.close()

        return scenario

    async def main() -> None:
        await refused()
        await serve(silent, await expect(TimeoutError))
        await serve(hang_up, await expect(ReplicaUnreachable))
        await serve(garbage, await expect(ReplicaUnreachable))

    asyncio.run(main())


def test_a_cancelled_exchange_drops_its_connection() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            await asyncio.sleep(0.2)
            writer.write(answer(b'{"late": true}'))
            await writer.drain()

    async def scenario(url: str) -> None:
        client = ReplicaClient()
        task = asyncio.create_task(client.post(url, "/infer", b"{}", {}, 5))
        await asyncio.sleep(0.05)
        task.cancel()  # a hedge that lost
        with pytest.raises(asyncio.CancelledError):
            await task
        got = await client.post(url, "/infer", b"{}", {}, 5)  # a fresh connection
        assert got.content == b'{"late": true}'
        await client.close()

    asyncio.run(serve(slow, scenario))
