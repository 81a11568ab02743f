"""Websocket fuzzing, on our session websocket and on Realtime's (real server, real
sockets, the shared engine).

Seeded random frames, each invalid by construction: text that is not JSON, JSON that
is not an event object, unknown event types, known types with a forbidden extra
field or a wrongly typed or out-of-range value, numbers past Python's digit limit,
nesting too deep for the parser, binary frames, a flood of events, a message over
the size limit. Oracle: the protocol. Every invalid frame gets exactly one error
event and the connection stays open; afterwards the session still answers a valid
chunk. An oversized message closes its connection with 1009, and the session
(attached, so the protocol keeps it) is still usable over REST. A flood is
answered (events or rate-limit errors) and leaves the connection usable.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
import websockets

from tests.conftest import API_KEYS, auth, make_settings
from tests.helpers import close_code, running_app

pytestmark = pytest.mark.server

HEADERS = auth()
FRAMES_PER_ENDPOINT = 120
MAX_MESSAGE = 256 * 1024


def random_json(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(7 if depth < 3 else 4)
    if choice == 0:
        return rng.choice([None, True, False])
    if choice == 1:
        return rng.choice([0, -1, 2**63, 1.5, -1e308, 10**30])
    if choice == 2:
        return "".join(rng.choice(string.printable + "é中\u2028") for _ in range(rng.randrange(12)))
    if choice == 3:
        return rng.randrange(-5, 1000)
    if choice == 4:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        rng.choice(["type", "input", "session", "item", "x", ""]): random_json(rng, depth + 1)
        for _ in range(rng.randrange(4))
    }


def invalid_frames(rng: random.Random, event_types: list[str], corruptions: list[dict[str, Any]]) -> list[str]:
    """Frames no protocol accepts: each must be answered with one error event."""
    frames: list[str] = []
    for _ in range(FRAMES_PER_ENDPOINT):
        kind = rng.randrange(8)
        if kind == 0:  # not JSON
            frames.append("{" + "".join(rng.choice(string.printable) for _ in range(rng.randrange(40))))
        elif kind == 1:  # JSON, not an object
            frames.append(json.dumps([random_json(rng)] if rng.random() < 0.5 else rng.choice([1, "s", None, 2.5])))
        elif kind == 2:  # an unknown type
            frames.append(json.dumps({"type": "no.such." + str(rng.randrange(1000)), "x": random_json(rng)}))
        elif kind == 3:  # an object with no string type
            frames.append(json.dumps({"type": random_json(rng, 3) if rng.random() < 0.5 else 7, "input": [1]}))
        elif kind == 4:  # a known type, broken in a way the protocol forbids
            frames.append(json.dumps({"type": rng.choice(event_types), **rng.choice(corruptions)}))
        elif kind == 5:  # an integer past Python's 4300-digit limit
            frames.append('{"type": "' + rng.choice(event_types) + '", "max_tokens": ' + "9" * 5000 + "}")
        elif kind == 6:  # nested deeper than the parser recurses
            depth = 100_000
            frames.append('{"type": "x", "a": ' + "[" * depth + "]" * depth + "}")
        else:  # invalid UTF-8 sent as text is refused by the websocket layer; send odd unicode instead
            frames.append(json.dumps({"type": "\ud7ff\u2028" + "".join(rng.choice("\x00\x1f\x7f") for _ in range(3))}))
    return frames


SESSION_CORRUPTIONS: list[dict[str, Any]] = [
    {"input": {"a": 1}},
    {"input": []},
    {"input": ""},
    {"input": [1, -4]},
    {"input": 3.5},
    {"input": [1], "max_tokens": 0},
    {"input": [1], "max_tokens": "many"},
    {"input": [1], "temperature": -1},
    {"input": [1], "unknown_field": True},
    {"session": "not an object"},
    {"session": {"defaults": 5}},
    {"input": [1], "top_p": float("nan")},
    {"input": [1], "stop_token_ids": list(range(100))},
]
REALTIME_CORRUPTIONS: list[dict[str, Any]] = [
    {"item": 5},
    {"item": {"type": "message", "role": "user", "content": "not a list"}},
    {"session": "not an object"},
    {"session": {"type": "transcription"}},
    {"session": {"type": "realtime", "output_modalities": ["audio"]}},
    {"response": {"output_modalities": ["audio"]}},
    {"item_id": 12},
]
SESSION_TYPES = ["input.append", "session.update"]
REALTIME_TYPES = ["conversation.item.create", "session.update", "conversation.item.retrieve"]


async def read_json(ws: Any) -> dict[str, Any]:
    return dict(json.loads(await ws.recv()))


async def send_all_expecting_errors(ws: Any, frames: list[str]) -> None:
    for frame in frames:
        await ws.send(frame)
        reply = await read_json(ws)
        assert reply["type"] == "error", (frame[:200], reply)
        error = reply["error"]
        assert error["message"] and error["code"], reply
    await ws.send(b"\x00\x01 binary")
    reply = await read_json(ws)
    assert reply["type"] == "error" and reply["error"]["code"] == "invalid_event", reply


@pytest_asyncio.fixture
async def app_url(engine: Any) -> AsyncIterator[str]:
    # Its own server: a smaller message limit (to cross it cheaply), events not rate limited.
    settings = make_settings(api_keys=list(API_KEYS), ws_max_message_bytes=MAX_MESSAGE, ws_events_per_second=0)
    async with running_app(settings, engine) as url:
        yield url


async def open_session(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=60) as http:
        created = await http.post("/v1/sessions", json={"defaults": {"temperature": 0}})
        assert created.status_code == 201
        return str(created.json()["id"])


async def chunk_answers(url: str, session_id: str) -> None:
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=60) as http:
        reply = await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": [3, 4], "max_tokens": 1})
        assert reply.status_code == 200, reply.text


async def test_session_websocket_survives_invalid_frames(app_url: str) -> None:
    frames = invalid_frames(random.Random(1), SESSION_TYPES, SESSION_CORRUPTIONS)
    session_id = await open_session(app_url)
    ws_url = app_url.replace("http://", "ws://") + f"/v1/sessions/{session_id}/ws"
    async with websockets.connect(ws_url, additional_headers=HEADERS, max_size=None) as ws:
        assert (await read_json(ws))["type"] == "session.updated"
        await send_all_expecting_errors(ws, frames)
        await ws.send(json.dumps({"type": "input.append", "input": [5, 6], "max_tokens": 2}))
        while (event := await read_json(ws))["type"] != "response.done":
            assert event["type"] == "response.output.delta", event
        # A flood: every event answered, in order, and the connection goes on.
        for _ in range(200):
            await ws.send(json.dumps({"type": "session.update", "session": {"max_tokens": 3}}))
        replies = [(await read_json(ws))["type"] for _ in range(200)]
        assert replies == ["session.updated"] * 200
        # Over the size limit: closed with 1009 ...
        await ws.send(json.dumps({"type": "input.append", "input": "y" * MAX_MESSAGE}))
        assert await close_code(ws) == 1009
    # ... and the attached session is still there and answers.
    await chunk_answers(app_url, session_id)


async def test_realtime_websocket_survives_invalid_frames(app_url: str) -> None:
    frames = invalid_frames(random.Random(2), REALTIME_TYPES, REALTIME_CORRUPTIONS)
    session_id = await open_session(app_url)
    ws_url = app_url.replace("http://", "ws://") + f"/v1/realtime?model=embedded-tiny&session_id={session_id}"
    async with websockets.connect(ws_url, additional_headers=HEADERS, max_size=None) as ws:
        assert (await read_json(ws))["type"] == "session.created"
        await send_all_expecting_errors(ws, frames)
        # The conversation still works: an item, a response.
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 2}}))
        while (event := await read_json(ws))["type"] != "response.done":
            assert event["type"] != "error", event
        done = event["response"]
        # An answer: cut at its 2 tokens (incomplete), or ended on its own (sampled).
        assert done["status"] == "completed" or done["status_details"]["reason"] == "max_output_tokens", event
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item, "pad": "z" * MAX_MESSAGE}))
        assert await close_code(ws) == 1009
    await chunk_answers(app_url, session_id)


async def test_rest_bodies_nested_too_deep_or_with_huge_numbers_get_400(app_url: str) -> None:
    deep = '{"input": ' + "[" * 100_000 + "]" * 100_000 + "}"
    huge = '{"input": [1], "max_tokens": ' + "9" * 5000 + "}"
    session_id = await open_session(app_url)
    async with httpx.AsyncClient(
        base_url=app_url, headers={**HEADERS, "content-type": "application/json"}, timeout=60
    ) as http:
        for path in (f"/v1/sessions/{session_id}/chunks", "/v1/sessions", "/v1/completions", "/v1/chat/completions"):
            for body in (deep, huge):
                reply = await http.post(path, content=body)
                assert reply.status_code == 400, (path, reply.status_code, reply.text[:300])
                assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    await chunk_answers(app_url, session_id)
