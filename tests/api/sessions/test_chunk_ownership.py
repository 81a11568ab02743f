"""One owner for every chunk: a client that hangs up at the worst moment leaves no
session locked, whatever transport it used.

Each scenario sends a chunk and drops the connection at once (in the same burst of
writes, with no closing handshake), then
sends the session a REST chunk: it must be answered 200 within a bounded time, every
time, over ``REPETITIONS`` tries. 409 ``chunk_in_flight`` is allowed only while the
abandoned chunk is being undone (bounded by ``RELEASED_WITHIN_S``). Before the ChunkRun
the Realtime scenario failed here at once ("still locked after 10 s", run on commit
723a2ae): the lock of a response that never started streaming was never released. Oracle: the session's own answers (a
lock either is released or it is not); no engine numerics are compared.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import websockets

from tests.conftest import auth

pytestmark = pytest.mark.server

REPETITIONS = 50
RELEASED_WITHIN_S = 10.0


async def next_chunk_answered(http: httpx.AsyncClient, session_id: str) -> None:
    """The session's next REST chunk is answered 200 within RELEASED_WITHIN_S."""
    deadline = time.monotonic() + RELEASED_WITHIN_S
    while True:
        reply = await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": [5, 6], "max_tokens": 1})
        if reply.status_code == 200:
            return
        assert reply.status_code == 409 and reply.json()["error"]["code"] == "chunk_in_flight", reply.text
        assert time.monotonic() < deadline, f"session {session_id} still locked after {RELEASED_WITHIN_S} s"
        await asyncio.sleep(0.05)


def hang_up(transport: asyncio.BaseTransport) -> None:
    """Drop the connection at once, as a client that dies does: no closing handshake.
    (With a websocket closing handshake the old code happened to survive; dropped, the
    Realtime session stayed locked.)"""
    transport.abort()  # type: ignore[attr-defined]


async def raw_post_and_hang_up(server: str, path: str, body: dict[str, Any]) -> None:
    """A whole request in one write, then the socket closed at once."""
    host, port = server.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: {auth()['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    hang_up(writer.transport)


async def realtime_burst(server: str, session_id: str) -> None:
    url = server.replace("http://", "ws://") + f"/v1/realtime?model=embedded-tiny&session_id={session_id}"
    async with websockets.connect(url, additional_headers=auth()) as ws:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 64}}))
        hang_up(ws.transport)


async def websocket_burst(server: str, session_id: str) -> None:
    url = server.replace("http://", "ws://") + f"/v1/sessions/{session_id}/ws"
    async with websockets.connect(url, additional_headers=auth()) as ws:
        await ws.send(json.dumps({"type": "input.append", "input": [7, 8, 9], "max_tokens": 64}))
        hang_up(ws.transport)


async def rest_hang_up(server: str, session_id: str) -> None:
    await raw_post_and_hang_up(server, f"/v1/sessions/{session_id}/chunks", {"input": [7, 8, 9], "max_tokens": 64})


async def sse_hang_up(server: str, session_id: str) -> None:
    await raw_post_and_hang_up(
        server, f"/v1/sessions/{session_id}/chunks", {"input": [7, 8, 9], "max_tokens": 64, "stream": True}
    )


@pytest.mark.parametrize(
    "hang_up",
    [realtime_burst, websocket_burst, rest_hang_up, sse_hang_up],
    ids=["realtime", "websocket", "rest", "sse"],
)
async def test_a_client_that_hangs_up_at_once_leaves_the_session_usable(
    server: str, hang_up: Callable[[str, str], Awaitable[None]]
) -> None:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        created = await http.post("/v1/sessions", json={"defaults": {"temperature": 0, "ignore_eos": True}})
        session_id = created.json()["id"]
        for _ in range(REPETITIONS):
            await hang_up(server, session_id)
            await next_chunk_answered(http, session_id)
        state = (await http.get(f"/v1/sessions/{session_id}")).json()
        assert state["status"] in ("active", "parked") and state["num_chunks"] >= REPETITIONS, state
        await http.delete(f"/v1/sessions/{session_id}")
