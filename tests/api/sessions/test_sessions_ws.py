"""Sessions over a real websocket: events, ordering, bad events, auth, attach."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
import websockets

from tests.conftest import auth
from tests.helpers import (
    close_code,
    live_request_ids,
    random_tokens,
    wait_until_closed,
    wait_until_gone,
)

pytestmark = pytest.mark.server


def ws_url(server: str, path: str) -> str:
    return server.replace("http://", "ws://") + path


async def recv(ws: Any) -> dict[str, Any]:
    event = json.loads(await ws.recv())
    assert "type" in event and "event_id" in event
    return dict(event)


async def collect_chunk(ws: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    deltas = []
    while (event := await recv(ws))["type"] == "response.output.delta":
        deltas.append(event)
    assert event["type"] == "response.done", event
    return deltas, event


async def test_websocket_session_matches_rest(server: str) -> None:
    rng = random.Random(3)
    chunks = [random_tokens(rng, n) for n in (30, 5, 17)]
    settings = {"temperature": 0, "ignore_eos": True, "max_tokens": 5}

    rest_outputs = []
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=120) as http:
        session_id = (await http.post("/v1/sessions", json={"defaults": settings})).json()["id"]
        for chunk in chunks:
            rest_outputs.append((await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": chunk})).json())
        await http.delete(f"/v1/sessions/{session_id}")

    async with websockets.connect(ws_url(server, "/v1/sessions/ws"), additional_headers=auth()) as ws:
        created = await recv(ws)
        assert created["type"] == "session.created" and created["session"]["status"] == "active"
        await ws.send(json.dumps({"type": "session.update", "session": settings}))
        updated = await recv(ws)
        assert updated["type"] == "session.updated" and updated["session"]["defaults"]["max_tokens"] == 5
        # Appends sent back to back queue up and run in order.
        for i, chunk in enumerate(chunks):
            await ws.send(json.dumps({"type": "input.append", "input": chunk, "event_id": f"c{i}"}))
        for index, expected in enumerate(rest_outputs):
            deltas, done = await collect_chunk(ws)
            assert done["chunk_index"] == index
            assert [t for d in deltas for t in d["delta"]["token_ids"]] == done["output"]["token_ids"]
            assert done["output"]["token_ids"] == expected["output"]["token_ids"]
            assert done["usage"] == expected["usage"]
        await ws.send(json.dumps({"type": "session.close"}))
        closed = await recv(ws)
        assert closed["type"] == "session.closed"


async def test_bad_events_leave_connection_and_session_usable(server: str) -> None:
    async with websockets.connect(ws_url(server, "/v1/sessions/ws"), additional_headers=auth()) as ws:
        await recv(ws)
        bad_events = [
            ("not json", "invalid_json", None),
            (json.dumps({"type": "input.explode", "event_id": "e1"}), "invalid_event", "e1"),
            (json.dumps({"type": "input.append", "event_id": "e2"}), "invalid_event", "e2"),
            (
                json.dumps({"type": "input.append", "input": [1], "max_tokens": 0, "event_id": "e3"}),
                "invalid_event",
                "e3",
            ),
            (
                json.dumps({"type": "input.append", "input": [1], "max_tokens": 10**6, "event_id": "e4"}),
                "max_tokens_too_large",
                "e4",
            ),
            (json.dumps([1, 2]), "invalid_event", None),
        ]
        for raw, code, event_id in bad_events:
            await ws.send(raw)
            error = await recv(ws)
            assert error["type"] == "error", error
            assert set(error["error"]) >= {"type", "code", "message", "param", "event_id"}
            assert error["error"]["code"] == code and error["error"]["event_id"] == event_id
        await ws.send(json.dumps({"type": "input.append", "input": [1, 2, 3], "max_tokens": 2}))
        _, done = await collect_chunk(ws)
        assert done["chunk_index"] == 0 and done["usage"]["completion_tokens"] == 2


async def test_websocket_needs_a_key(server: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        async with websockets.connect(ws_url(server, "/v1/sessions/ws"), additional_headers=headers) as ws:
            error = await recv(ws)
            assert error["type"] == "error" and error["error"]["code"] == "invalid_api_key"
            assert await close_code(ws) == 1008


async def test_attach_to_rest_session(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=120) as http:
        session_id = (await http.post("/v1/sessions", json={"defaults": {"temperature": 0}})).json()["id"]
        await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": [5, 6, 7], "max_tokens": 3})
        async with websockets.connect(ws_url(server, f"/v1/sessions/{session_id}/ws"), additional_headers=auth()) as ws:
            hello = await recv(ws)
            assert hello["type"] == "session.updated" and hello["session"]["num_chunks"] == 1
            await ws.send(json.dumps({"type": "input.append", "input": [8, 9], "max_tokens": 2}))
            _, done = await collect_chunk(ws)
            assert done["chunk_index"] == 1
        # Detaching leaves an attached session open.
        state = (await http.get(f"/v1/sessions/{session_id}")).json()
        assert state["status"] == "active" and state["num_chunks"] == 2
        async with websockets.connect(ws_url(server, "/v1/sessions/sess_missing/ws"), additional_headers=auth()) as ws:
            error = await recv(ws)
            assert error["error"]["code"] == "session_not_found"
        async with websockets.connect(
            ws_url(server, f"/v1/sessions/{session_id}/ws"), additional_headers=auth("test-key-bob")
        ) as ws:
            assert (await recv(ws))["error"]["code"] == "session_not_found"
        await http.delete(f"/v1/sessions/{session_id}")


async def test_websocket_disconnect_mid_chunk_closes_its_session(server: str, engine: Any) -> None:
    async with websockets.connect(ws_url(server, "/v1/sessions/ws"), additional_headers=auth()) as ws:
        session_id = (await recv(ws))["session"]["id"]
        await ws.send(json.dumps({"type": "input.append", "input": [4] * 10, "max_tokens": 1000}))
        assert (await recv(ws))["type"] == "response.output.delta"
        assert session_id in live_request_ids(engine)
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        state = await wait_until_closed(http, session_id)
        assert state["status"] == "closed"
    assert await wait_until_gone(engine, session_id)


async def test_attached_websocket_disconnect_mid_chunk_undoes_the_chunk_and_keeps_the_session(
    server: str, engine: Any
) -> None:
    """An attached session outlives its connection: a drop mid-chunk undoes that
    chunk only (the engine request aborted, the session parked before it)."""
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        session_id = (await http.post("/v1/sessions", json={"defaults": {"temperature": 0}})).json()["id"]
        assert (
            await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": [7, 7], "max_tokens": 2})
        ).status_code == 200
        async with websockets.connect(ws_url(server, f"/v1/sessions/{session_id}/ws"), additional_headers=auth()) as ws:
            assert (await recv(ws))["type"] == "session.updated"
            await ws.send(
                json.dumps({"type": "input.append", "input": [4] * 10, "max_tokens": 1000, "ignore_eos": True})
            )
            assert (await recv(ws))["type"] == "response.output.delta"
            assert session_id in live_request_ids(engine)
        assert await wait_until_gone(engine, session_id)
        state = (await http.get(f"/v1/sessions/{session_id}")).json()
        assert state["status"] == "parked" and state["num_chunks"] == 1, state
        again = await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": [4] * 10, "max_tokens": 2})
        assert again.status_code == 200 and again.json()["index"] == 1
        await http.delete(f"/v1/sessions/{session_id}")
