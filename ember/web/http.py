"""uvicorn's httptools protocol, answering in one write.

uvicorn writes a response's status line and headers when the app sends
``http.response.start`` and the body when it sends ``http.response.body``: two ``write``
calls, so two ``send`` syscalls and two TCP segments (uvloop sets ``TCP_NODELAY``), and the
peer's event loop wakes for the head and again for the body. On the gateway's hop to a
replica that happens twice per prediction, once per process, and on a host where the API
and its replicas share cores each wake-up is a context switch. Measured here (minilm, 10
req/s, API and replica on one core): the gateway read a replica's answer 0.10 ms after its
first byte, and each of the two processes spent 0.10-0.14 ms in its two writes.

``CoalescingProtocol`` holds the head until the first body message and writes both in one
``write``. An app that sends the head and then waits (a stream whose first chunk is slow)
still has its head on the wire on the loop's next turn. Everything else is uvicorn's own
code: the cycle's ``send`` runs unchanged against a stand-in transport that collects what
it would have written (``close`` included, done after the write). ``SERVER_OPTIONS`` is
how every Ember server runs uvicorn (the API, ``ember engine``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class _Collected:
    """What the cycle's ``send`` would have done to the transport, to be done at once."""

    __slots__ = ("closing", "data", "real")

    def __init__(self, real: Any) -> None:
        self.real = real
        self.data: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.data.append(data)

    def close(self) -> None:
        self.closing = True

    def __getattr__(self, name: str) -> Any:  # anything else uvicorn asks of the transport
        return getattr(self.real, name)


class _Cycle(RequestResponseCycle):
    """A cycle whose head waits for the body (``_held``), or the loop's next turn."""

    _held: bytes | None = None

    async def send(self, message: Any) -> None:
        if self.response_started and self._held is None:  # a stream's later chunks
            await super().send(message)
            return
        starting = not self.response_started
        real = self.transport
        collected = _Collected(real)
        self.transport = collected  # type: ignore[assignment]
        try:
            await super().send(message)
        finally:
            self.transport = real
        data = b"".join(collected.data)
        if starting and self.response_started:  # the head: held for the body
            self._held = data
            asyncio.get_running_loop().call_soon(self._flush)
        elif self._held is not None:
            data, self._held = self._held + data, None
        if data and self._held is None and not self.disconnected and not real.is_closing():
            real.write(data)
        if collected.closing:
            real.close()

    def _flush(self) -> None:
        """The head alone, when no body followed it in the same turn of the loop."""
        held, self._held = self._held, None
        if held and not self.disconnected and not self.transport.is_closing():
            self.transport.write(held)


class CoalescingProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose cycles answer in one write (``_Cycle``)."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if type(self.cycle) is RequestResponseCycle:
            self.cycle.__class__ = _Cycle


SERVER_OPTIONS: dict[str, Any] = {
    "http": CoalescingProtocol,  # head and body in one write
    "server_header": False,  # no `server: uvicorn` on any answer
    "log_config": None,  # Ember's logging (ember.logs), not uvicorn's
    "access_log": False,
}
"""``uvicorn.run(app, host=..., port=..., **SERVER_OPTIONS)``: how every Ember server runs."""
