"""CoalescingTransport: one loop tick's writes reach the socket as one write.

The oracle is what reaches a real socket: the server side of a socketpair served by
asyncio's own transport, read with the bytes counted per write through a recording
wrapper around it. (Every server test also runs through this protocol.)
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from app.http.uvicorn_protocol import CoalescingTransport


class RecordingTransport:
    """asyncio's transport, with every write it is given recorded."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def _socket_pair() -> tuple[CoalescingTransport, RecordingTransport, socket.socket]:
    """Our transport, the asyncio transport under it (recording), and the peer socket."""
    ours, theirs = socket.socketpair()
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, ours)
    theirs.setblocking(False)
    recording = RecordingTransport(transport)
    return CoalescingTransport(recording), recording, theirs  # type: ignore[arg-type]


async def _read(sock: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < size:
        data += await loop.sock_recv(sock, size - len(data))
    return data


async def test_writes_in_one_tick_go_out_as_one() -> None:
    transport, recording, peer = await _socket_pair()
    transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    transport.write(b"{}")
    assert recording.writes == []  # nothing before the tick ends
    await asyncio.sleep(0)
    assert recording.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    assert await _read(peer, 40) == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
    recording.close()
    peer.close()


async def test_writes_in_different_ticks_are_not_held() -> None:
    transport, recording, peer = await _socket_pair()
    transport.write(b"a")
    await asyncio.sleep(0)
    transport.write(b"b")
    await asyncio.sleep(0)
    assert recording.writes == [b"a", b"b"]
    assert await _read(peer, 2) == b"ab"
    recording.close()
    peer.close()


async def test_close_sends_what_was_written_first() -> None:
    transport, recording, peer = await _socket_pair()
    transport.write(b"bye")
    assert transport.get_write_buffer_size() == 3
    transport.close()
    assert recording.writes == [b"bye"]
    assert await _read(peer, 3) == b"bye"
    await asyncio.sleep(0)  # the flush scheduled by the write finds nothing left
    assert recording.writes == [b"bye"]
    peer.close()


async def test_a_whole_response_goes_out_before_the_app_returns() -> None:
    """The protocol sends a response as soon as its last body part is given, not at the
    end of the tick: the app still running after answering does not hold it back.
    Negative control: without ``on_response_complete``'s flush nothing is written yet
    when the app's next statement runs."""
    import uvicorn
    from uvicorn.server import ServerState

    from app.http.uvicorn_protocol import CoalescingHttpToolsProtocol

    ours, theirs = socket.socketpair()
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, ours)
    recording = RecordingTransport(transport)
    written_when_answered: list[list[bytes]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})
        written_when_answered.append(list(recording.writes))  # before any other tick

    config = uvicorn.Config(app, http=CoalescingHttpToolsProtocol, lifespan="off", log_level="warning")
    config.load()
    protocol = CoalescingHttpToolsProtocol(config, ServerState(), app_state={})
    protocol.connection_made(recording)  # type: ignore[arg-type]
    protocol.data_received(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n")
    theirs.setblocking(False)
    reply = await _read(theirs, 5)
    assert reply.startswith(b"HTTP/")
    assert len(written_when_answered) == 1
    [sent] = written_when_answered[0]  # headers and body in one write, already sent
    assert sent.startswith(b"HTTP/1.1 200 OK\r\n") and sent.endswith(b"\r\n\r\n{}")
    protocol.connection_lost(None)
    recording.close()
    theirs.close()
