"""The OpenAI Realtime API (GA, text) at /v1/realtime, driven by the official SDK.

``AsyncOpenAI(...).realtime.connect(model=...)`` against the real server (shared
float32 engine). The SDK builds the events it receives unchecked, so every frame is
read raw here and validated strictly with the SDK's own types
(``TypeAdapter(RealtimeServerEvent)``). Sessions are opened over REST with greedy
defaults and attached by id (``?session_id=``, our extension), so outputs are
deterministic; the token-equality oracle is our REST session API fed the same
rendered turns (float32 makes both sides' arithmetic the same: it is one engine).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from app.sessions.chat import render_turn
from tests.conftest import API_KEYS, auth

pytestmark = pytest.mark.server

SERVER_EVENTS: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
RESPONSE_EVENTS = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]
TURNS = ["Hello there, model.", "Tell me more about that.", "And one last thing?"]


class Frames:
    """Every frame the server sent, validated with the SDK's types."""

    def __init__(self, connection: Any):
        self.connection = connection
        self.seen: list[dict[str, Any]] = []

    async def next(self) -> dict[str, Any]:
        data = json.loads(await self.connection.recv_bytes())
        SERVER_EVENTS.validate_python(data, strict=True)
        self.seen.append(data)
        return dict(data)

    async def until(self, kind: str) -> list[dict[str, Any]]:
        events = [await self.next()]
        while events[-1]["type"] != kind:
            events.append(await self.next())
        return events


async def greedy_session(http: httpx.AsyncClient) -> str:
    created = await http.post("/v1/sessions", json={"defaults": {"temperature": 0, "ignore_eos": True}})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


async def close_sessions(server: str, *session_ids: str) -> None:
    """Attached sessions outlive their connections: close them, freeing the device."""
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        for session_id in session_ids:
            assert (await http.delete(f"/v1/sessions/{session_id}")).status_code == 200


@asynccontextmanager
async def realtime(server: str, session_id: str | None = None) -> AsyncIterator[tuple[Any, Frames]]:
    client = AsyncOpenAI(
        api_key=API_KEYS[0], base_url=f"{server}/v1", websocket_base_url=server.replace("http://", "ws://") + "/v1"
    )
    query = {"session_id": session_id} if session_id else {}
    async with client.realtime.connect(model="embedded-tiny", extra_query=query, max_retries=0) as connection:
        frames = Frames(connection)
        hello = await frames.next()
        assert hello["type"] == "session.created" and hello["session"]["type"] == "realtime"
        yield connection, frames


async def turn(connection: Any, frames: Frames, text: str, item_id: str | None = None) -> list[dict[str, Any]]:
    item: dict[str, Any] = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    if item_id:
        item["id"] = item_id
    await connection.conversation.item.create(item=item)
    added, done = await frames.next(), await frames.next()
    assert [added["type"], done["type"]] == ["conversation.item.added", "conversation.item.done"]
    if item_id:
        assert added["item"]["id"] == done["item"]["id"] == item_id  # echoed
    await connection.response.create()
    return await frames.until("response.done")


def assert_response_sequence(events: list[dict[str, Any]], status: str) -> None:
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    collapsed = [k for i, k in enumerate(kinds) if k != "response.output_text.delta" or kinds[i - 1] != k]
    assert collapsed == RESPONSE_EVENTS, kinds
    response_ids = {e["response_id"] for e in events if "response_id" in e}
    assert response_ids == {events[0]["response"]["id"]}  # stable across the response
    item_ids = {e["item_id"] for e in events if "item_id" in e} | {e["item"]["id"] for e in events if "item" in e}
    assert len(item_ids) == 1
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert next(e for e in events if e["type"] == "response.output_text.done")["text"] == text
    done = events[-1]["response"]
    assert done["status"] == status and done["output"][0]["content"][0]["text"] == text
    usage = done["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


async def test_three_turns_with_streamed_deltas_and_cached_earlier_turns(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        session_id = await greedy_session(http)
    async with realtime(server, session_id) as (connection, frames):
        await connection.session.update(
            session={
                "type": "realtime",
                "instructions": "Be brief.",
                "max_output_tokens": 8,
                "output_modalities": ["text"],
            }
        )
        updated = await frames.next()
        assert updated["type"] == "session.updated"
        assert updated["session"]["instructions"] == "Be brief." and updated["session"]["max_output_tokens"] == 8
        # An audio block, as the Agents SDK's Realtime model always sends one: accepted with
        # text output (it changes nothing), echoed back.
        audio = {
            "input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None},
            "output": {"voice": "alloy"},
        }
        await connection.session.update(session={"type": "realtime", "audio": audio})  # type: ignore[typeddict-item]
        echoed = await frames.next()
        assert echoed["type"] == "session.updated", echoed
        assert echoed["session"]["audio"]["output"]["voice"] == "alloy"
        assert echoed["session"]["instructions"] == "Be brief."
        usages = []
        for index, text in enumerate(TURNS):
            events = await turn(connection, frames, text, item_id=f"item_user_{index}")
            # Cut at max_output_tokens (ignore_eos): incomplete, as OpenAI reports it.
            assert_response_sequence(events, "incomplete")
            assert events[-1]["response"]["status_details"]["reason"] == "max_output_tokens"
            usages.append(events[-1]["response"]["usage"])
        assert all(u["output_tokens"] == 8 for u in usages)
        # Turn 3 reuses the session's KV: every earlier token is a device hit.
        third = usages[2]["input_token_details"]
        earlier = usages[1]["input_tokens"] + usages[1]["output_tokens"] - 1
        assert third["cached_tokens"] == third["device_tokens"] == earlier
        assert third["computed_tokens"] == usages[2]["input_tokens"] - earlier
        # Every event id is unique.
        ids = [e["event_id"] for e in frames.seen]
        assert len(ids) == len(set(ids))
        # conversation.item.retrieve answers with an item, old or new.
        await connection.conversation.item.retrieve(item_id="item_user_0")
        retrieved = await frames.next()
        assert retrieved["type"] == "conversation.item.retrieved"
        assert retrieved["item"]["content"][0]["text"] == TURNS[0]
    await close_sessions(server, session_id)


async def test_realtime_gives_the_same_tokens_as_the_rest_session_api(server: str, engine: Any) -> None:
    tokenizer = engine.get_tokenizer()
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        over_realtime, over_rest = await greedy_session(http), await greedy_session(http)
        async with realtime(server, over_realtime) as (connection, frames):
            await connection.session.update(session={"type": "realtime", "max_output_tokens": 6})
            await frames.next()
            texts = []
            for text in TURNS:
                events = await turn(connection, frames, text)
                texts.append(events[-1]["response"]["output"][0]["content"][0]["text"])
        rest_texts = []
        for text in TURNS:
            context = (await http.get(f"/v1/sessions/{over_rest}/transcript")).json()["token_ids"]
            rendered = render_turn(tokenizer, [{"role": "user", "content": text}], context)
            ids = tokenizer.encode(rendered, add_special_tokens=False)
            reply = await http.post(f"/v1/sessions/{over_rest}/chunks", json={"input": ids, "max_tokens": 6})
            assert reply.status_code == 200, reply.text
            rest_texts.append(reply.json()["output"]["text"])
        assert texts == rest_texts
        transcripts = [
            (await http.get(f"/v1/sessions/{s}/transcript")).json()["token_ids"] for s in (over_realtime, over_rest)
        ]
        assert transcripts[0] == transcripts[1] and len(transcripts[0]) > 30
    await close_sessions(server, over_realtime, over_rest)


async def test_cancel_mid_response_then_the_conversation_goes_on(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        session_id = await greedy_session(http)
        async with realtime(server, session_id) as (connection, frames):
            await connection.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]}
            )
            await frames.until("conversation.item.done")
            await connection.response.create(response={"max_output_tokens": 800})
            events = await frames.until("response.output_text.delta")
            await connection.response.cancel()
            events += await frames.until("response.done")
            assert_response_sequence(events, "cancelled")
            generated = events[-1]["response"]["usage"]["output_tokens"]
            assert 1 <= generated < 800
            assert events[-1]["response"]["output"][0]["status"] == "incomplete"
            # The session kept what was generated, and answers the next turn.
            state = (await http.get(f"/v1/sessions/{session_id}")).json()
            assert state["status"] != "closed" and state["num_chunks"] == 1
            assert_response_sequence(await turn(connection, frames, "Thanks."), "incomplete")
    await close_sessions(server, session_id)


async def test_bad_events_get_error_events_and_the_conversation_goes_on(server: str) -> None:
    async with realtime(server) as (connection, frames):
        # previous_item_id may name the end ("root" while empty, then the last item), not an
        # earlier place: a streaming session only appends.
        first = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}

        async def add(previous_item_id: str) -> dict[str, Any]:
            await connection.send_raw(
                json.dumps({"type": "conversation.item.create", "item": first, "previous_item_id": previous_item_id})
            )
            added = await frames.next()
            assert added["type"] == "conversation.item.added", added
            await frames.next()  # conversation.item.done
            return dict(added)

        head = (await add("root"))["item"]["id"]
        assert (await add(head))["previous_item_id"] == head
        ratio = {"type": "retention_ratio", "retention_ratio": 0.5}
        await connection.send_raw(
            json.dumps({"type": "session.update", "session": {"type": "realtime", "truncation": ratio}})
        )
        updated = await frames.next()
        assert updated["type"] == "session.updated" and updated["session"]["truncation"] == ratio, updated
        bad: list[tuple[Any, str]] = [
            (
                json.dumps({"type": "conversation.item.create", "previous_item_id": "root", "item": first}),
                "unsupported_on_session",
            ),
            ("{not json", "invalid_json"),
            (json.dumps({"type": "no.such.event"}), "invalid_event_type"),
            (
                json.dumps({"type": "conversation.item.delete", "item_id": "x", "event_id": "mine"}),
                "unsupported_on_session",
            ),
            (
                json.dumps({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["audio"]}}),
                "unsupported_modality",
            ),
            (
                json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user"}}),
                "invalid_event",
            ),
            (json.dumps({"type": "response.cancel"}), "response_cancel_not_active"),
            (json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}), "audio_not_supported"),
            (
                json.dumps({"type": "session.update", "session": {"type": "realtime", "max_output_tokens": -1}}),
                "invalid_value",
            ),
            (json.dumps({"type": "response.create", "response": {"max_output_tokens": -5}}), "invalid_value"),
            (
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {
                            "type": "realtime",
                            "truncation": {"type": "retention_ratio", "retention_ratio": 0},
                        },
                    }
                ),
                "invalid_value",
            ),
            (
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {
                            "type": "realtime",
                            "truncation": {
                                "type": "retention_ratio",
                                "retention_ratio": 0.5,
                                "token_limits": {"post_instructions": 99},
                            },
                        },
                    }
                ),
                "unsupported_value",
            ),
        ]
        for raw, code in bad:
            await connection.send_raw(raw)
            error = await frames.next()
            assert error["type"] == "error" and error["error"]["code"] == code, error
            assert set(error["error"]) >= {"type", "code", "message"}
            if "mine" in raw:
                assert error["error"]["event_id"] == "mine"  # the client event it answers
        await connection.send_raw(
            json.dumps(
                {
                    "type": "conversation.item.truncate",
                    "item_id": "x",
                    "content_index": 0,
                    "audio_end_ms": 0,
                    "event_id": "evt_client_1",
                }
            )
        )
        truncate_error = await frames.next()
        assert truncate_error["error"]["event_id"] == "evt_client_1"  # the client's event, named
        events = await turn(connection, frames, "Still there?")
        done = events[-1]["response"]
        # The conversation goes on: an answer (sampled: it ends on its own or is cut).
        assert done["status"] == "completed" or done["status_details"]["reason"] == "max_output_tokens", done
        assert done["usage"]["output_tokens"] >= 1


async def test_a_connection_without_session_id_opens_its_own_session_and_closes_it(server: str) -> None:
    async with realtime(server) as (_connection, frames):
        session_id = frames.seen[0]["session"]["id"]
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        for _ in range(50):
            state = (await http.get(f"/v1/sessions/{session_id}")).json()
            if state["status"] == "closed":
                break
            await asyncio.sleep(0.1)
        assert state["status"] == "closed" and state["close_reason"] == "connection_closed"


async def test_beta_clients_and_unknown_models_are_refused_clearly(server: str) -> None:
    import websockets

    url = server.replace("http://", "ws://") + "/v1/realtime?model=embedded-tiny&extra=1"
    async with websockets.connect(url, additional_headers={**auth(), "OpenAI-Beta": "realtime=v1"}) as ws:
        refused = json.loads(await ws.recv())
        SERVER_EVENTS.validate_python(refused, strict=True)
        assert refused["error"]["code"] == "beta_protocol_unsupported"
    async with websockets.connect(url.replace("embedded-tiny", "gpt-4o"), additional_headers=auth()) as ws:
        assert json.loads(await ws.recv())["error"]["code"] == "model_not_found"
