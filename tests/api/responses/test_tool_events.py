"""Tool calls on the Responses API and Realtime, their events validated with the official
SDK's own types, strictly (the SDK itself accepts whatever it receives).

A server on the shared random-weight engine with the Hermes parser and the default
model's template (app/models/smollm2_chat_template.jinja): the calls are the grammar's
(tool_choice required, arguments pinned to the tool's schema), so their shape needs no
trained model. Oracles: the SDK's event and item types; the argument deltas add up to
the arguments of the done events and of the final items; each call round trip appends
only the tool's output (usage); the session's conversation renders the calls.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from app.models.smollm2 import CHAT_TEMPLATE
from tests.api.realtime.test_realtime import Frames, close_sessions
from tests.conftest import API_KEYS, auth, make_settings
from tests.helpers import running_app
from tests.http.test_schema_fuzz import operations_not_generated

pytestmark = pytest.mark.server

MODEL = "embedded-tiny"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": CITY}
STREAM_EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


@pytest_asyncio.fixture(scope="module")
async def tool_server(engine: Any) -> AsyncIterator[str]:
    settings = make_settings(api_keys=list(API_KEYS), tool_call_parser="hermes", chat_template=str(CHAT_TEMPLATE))
    async with running_app(settings, engine) as url:
        yield url


async def sse_events(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    async with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as stream:
        assert stream.status_code == 200, await stream.aread()
        async for line in stream.aiter_lines():
            if line.startswith("data: "):
                STREAM_EVENTS.validate_json(line[6:], strict=True)
                events.append(json.loads(line[6:]))
    return events


def calls_streamed(events: list[dict[str, Any]]) -> dict[str, str]:
    """Each function call item's arguments as its deltas add them up."""
    added = {
        e["item"]["id"]: ""
        for e in events
        if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
    }
    for event in events:
        if event["type"] == "response.function_call_arguments.delta":
            added[event["item_id"]] += event["delta"]
    return added


async def test_a_responses_tool_round_trip_streams_sdk_events(tool_server: str) -> None:
    async with httpx.AsyncClient(base_url=tool_server, headers=auth(), timeout=120) as http:
        body = {
            "model": MODEL,
            "input": "Weather in Paris?",
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_output_tokens": 160,
            "temperature": 0,
        }
        events = await sse_events(http, body)
        final = events[-1]
        assert final["type"] == "response.completed", final
        calls = [item for item in final["response"]["output"] if item["type"] == "function_call"]
        assert len(calls) >= 1 and all(call["name"] == "get_weather" for call in calls)
        assert all(json.loads(call["arguments"])["city"] in ("Paris", "Rome") for call in calls)
        streamed = calls_streamed(events)
        assert streamed == {call["id"]: call["arguments"] for call in calls}
        done = {e["item_id"]: e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"}
        assert done == streamed
        # The round trip: the tool's output is all that is appended.
        output = "It is sunny."
        second = await http.post(
            "/v1/responses",
            json={
                "model": MODEL,
                "previous_response_id": final["response"]["id"],
                "tools": [WEATHER],
                "tool_choice": "none",
                "max_output_tokens": 4,
                "temperature": 0,
                "input": [
                    {"type": "function_call_output", "call_id": call["call_id"], "output": output} for call in calls
                ],
            },
        )
        assert second.status_code == 200, second.text
        usage = second.json()["usage"]
        first_usage = final["response"]["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] >= first_usage["total_tokens"] - 32  # but a block
        assert [item["type"] for item in second.json()["output"]] == ["message"]  # tool_choice none: no call
        transcript = (await http.get(f"/v1/sessions/{final['response']['id']}/transcript")).json()["text"]
        assert transcript.count("<tool_response>\nIt is sunny.\n</tool_response>") == len(calls)
        assert '"name": "get_weather"' in transcript and "# Tools" in transcript
        await close_sessions(tool_server, final["response"]["id"])


async def test_a_realtime_tool_round_trip_streams_sdk_events(tool_server: str) -> None:
    # Greedy, so the round trip is the same every run: Realtime has no temperature, so the
    # session is opened over REST with greedy defaults and attached by id. (Sampled, the
    # random-weight model now and then spends all 160 tokens on the whitespace the call's
    # grammar allows, and the response ends incomplete.)
    async with httpx.AsyncClient(base_url=tool_server, headers=auth(), timeout=60) as http:
        created = await http.post("/v1/sessions", json={"defaults": {"temperature": 0}})
        assert created.status_code == 201, created.text
        session_id = created.json()["id"]
    client = AsyncOpenAI(
        api_key=API_KEYS[0],
        base_url=f"{tool_server}/v1",
        websocket_base_url=tool_server.replace("http://", "ws://") + "/v1",
    )
    async with client.realtime.connect(
        model=MODEL, extra_query={"session_id": session_id}, max_retries=0
    ) as connection:
        frames = Frames(connection)  # every server event validated with the SDK's union, strictly
        assert (await frames.next())["session"]["id"] == session_id
        await connection.session.update(session={"type": "realtime", "tools": [WEATHER], "tool_choice": "required"})
        updated = await frames.next()
        assert updated["type"] == "session.updated" and updated["session"]["tools"][0]["name"] == "get_weather"
        await connection.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}
        )
        await frames.until("conversation.item.done")
        # One call (greedy, this model would go on adding calls until the token limit).
        await connection.response.create(response={"max_output_tokens": 160, "parallel_tool_calls": False})
        events = await frames.until("response.done")
        response = events[-1]["response"]
        assert response["status"] == "completed", response
        calls = [item for item in response["output"] if item["type"] == "function_call"]
        assert len(calls) == 1 and all(json.loads(call["arguments"])["city"] in ("Paris", "Rome") for call in calls)
        streamed = {
            call["id"]: "".join(
                e["delta"]
                for e in events
                if e.get("item_id") == call["id"] and e["type"] == "response.function_call_arguments.delta"
            )
            for call in calls
        }
        assert streamed == {call["id"]: call["arguments"] for call in calls}
        kinds = [e["type"] for e in events]
        assert kinds.count("conversation.item.added") == kinds.count("conversation.item.done") == len(calls)
        # An output for no call is refused (as OpenAI checks call_id against the conversation);
        # the call's own output back, and an answer in words (this response's tool_choice: none).
        await connection.conversation.item.create(
            item={"type": "function_call_output", "call_id": "call_nope", "output": "Sunny."}
        )
        error = await frames.next()
        assert error["type"] == "error" and error["error"]["code"] == "tool_call_not_found", error
        for call in calls:
            await connection.conversation.item.create(
                item={"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny."}
            )
            await frames.until("conversation.item.done")
        await connection.response.create(response={"tool_choice": "none", "max_output_tokens": 4})
        answer = (await frames.until("response.done"))[-1]["response"]
        assert [item["type"] for item in answer["output"]] == ["message"]
        details = answer["usage"]["input_token_details"]
        assert details["cached_tokens"] >= response["usage"]["total_tokens"] - 32, answer["usage"]
        # Tools the server cannot honour are refused by name, and the connection goes on.
        await connection.session.update(session={"type": "realtime", "tools": [{"type": "mcp", "server_label": "x"}]})
        error = await frames.next()
        assert error["type"] == "error" and error["error"]["code"] == "unsupported_tool", error
    await close_sessions(tool_server, session_id)


async def test_chat_completions_and_conversations_carry_tool_calls(tool_server: str) -> None:
    """vLLM's own route with this server's parser settings (streamed calls too), and a
    conversation whose item log keeps the call and its output."""
    client = AsyncOpenAI(api_key=API_KEYS[0], base_url=f"{tool_server}/v1", max_retries=0)
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    messages: Any = [{"role": "user", "content": "Weather?"}]
    completion = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[chat_tool],
        tool_choice="required",
        max_tokens=160,
        temperature=0,
        parallel_tool_calls=False,
    )
    (call,) = completion.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[chat_tool],
        tool_choice="required",
        max_tokens=160,
        temperature=0,
        stream=True,
        parallel_tool_calls=False,
    )
    streamed = "".join(
        [
            tc.function.arguments or ""
            async for chunk in stream
            for tc in (chunk.choices[0].delta.tool_calls or [])
            if chunk.choices and tc.function
        ]
    )
    assert json.loads(streamed) == json.loads(call.function.arguments)

    conversation = await client.conversations.create()
    response = await client.responses.create(
        model=MODEL,
        input="Weather?",
        conversation=conversation.id,
        tools=[WEATHER],
        tool_choice="required",  # type: ignore[list-item]
        parallel_tool_calls=False,
        max_output_tokens=160,
        temperature=0,
    )
    (function_call,) = [item for item in response.output if item.type == "function_call"]
    await client.responses.create(
        model=MODEL,
        conversation=conversation.id,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=4,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": function_call.call_id, "output": "Sunny."}],
    )
    kinds = [item.type for item in (await client.conversations.items.list(conversation.id, order="asc")).data]
    assert kinds == ["message", "function_call", "function_call_output", "message"], kinds
    await close_sessions(tool_server, conversation.id)


async def test_a_batch_conversation_with_a_tool_call_is_answered(tool_server: str) -> None:
    """vLLM's batch route renders a conversation (which turns its tool calls' arguments
    into dicts, in place) and, with a parser, builds its request again from the same
    messages: every conversation with a tool call was refused (400; fresh-seed fuzzing
    with a parser). app/vllm_routes/fixes.py renders from a copy. Oracle: one answer each."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conversation = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
    ]
    # As the openai SDK sends a call back: content null, which pydantic reads into a lazy
    # iterator of calls (it cannot be copied: a 400 "cannot pickle", fresh seeds again).
    sent_back = [conversation[0], {**conversation[1], "content": None}, conversation[2]]
    async with httpx.AsyncClient(base_url=tool_server, headers=auth(), timeout=60) as http:
        response = await http.post(
            "/v1/chat/completions/batch",
            json={"model": MODEL, "messages": [conversation, conversation[:1], sent_back], "max_completion_tokens": 2},
        )
        assert response.status_code == 200, response.text
        assert [choice["index"] for choice in response.json()["choices"]] == [0, 1, 2]


async def test_every_operation_with_a_parser_can_be_generated(tool_server: str) -> None:
    # With a parser the chat request's rules differ (beam search's in place of the tool
    # rule): its schema must stay one schemathesis generates from (tests/http/test_schema_fuzz.py).
    assert await operations_not_generated(tool_server) == []
