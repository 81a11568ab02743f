"""uvicorn's HTTP protocol, with each event-loop tick's writes sent as one.

uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start``, and its body with the next message: two sends, so a small
JSON answer (a session chunk's) costs two syscalls and wakes the client twice, once
for headers that cannot be used without their body. Here a connection's writes wait
for the end of the loop tick they are made in and go out together: the headers and
body of a response sent at once leave in one send, and a streamed response's writes
are not delayed past the tick that made them. A response's last write goes out at once,
not at the end of its tick: what the app does after answering (its middlewares
returning, the request's listener cancelled) does not delay the answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """A transport whose writes within one loop tick reach the socket in one write.
    Everything else is the wrapped transport's (flow control's callbacks come from
    it to the protocol as before)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Send what this tick has written so far, now."""
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()  # what was written goes out before the close
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a ``CoalescingTransport`` (websockets upgraded
    from it write through it too)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._coalescing = CoalescingTransport(transport)
        super().connection_made(self._coalescing)  # type: ignore[arg-type]

    def on_response_complete(self) -> None:
        self._coalescing.flush()  # the response is whole: nothing more to wait for
        super().on_response_complete()
