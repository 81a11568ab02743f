"""The Responses and Conversations APIs on sessions, over real HTTP on the shared engine
(the random-weight tiny model: mechanics, not words; the real model's answers are
checked against chat completions in tests/api/responses/openai_stateful.py).

Oracles: the server's own sessions (a chain is one session whose chunks grow by one a
turn; a fork is a new session, the chain's left as it was), the usage's split of the
prompt (a continued turn computes only its new tokens), and OpenAI's error shape and
codes for each refusal, after which the chain or conversation still answers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import websockets

from tests.conftest import API_KEYS, auth
from tests.http.test_errors import assert_openai_error


def clean(text: str) -> str:
    """What a random reply's text and a decode of its ids agree on (test_realtime_conversation.py)."""
    return text.replace("<|endoftext|>", "").replace("\ufffd", "")


pytestmark = pytest.mark.server

MODEL = "embedded-tiny"
ENDED = ("response.completed", "response.incomplete")  # a response's last event


@pytest_asyncio.fixture
async def http(server: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=120) as client:
        yield client


@pytest_asyncio.fixture(autouse=True)
async def close_sessions_after(server: str) -> AsyncIterator[None]:
    """Chains, forks and conversations are sessions, open until idle: each test closes
    those it opened (the shared server holds at most 8), whatever its outcome."""
    yield
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        for key in API_KEYS:
            for session in (await http.get("/v1/sessions", headers=auth(key))).json()["data"]:
                await http.delete(f"/v1/sessions/{session['id']}", headers=auth(key))


@pytest_asyncio.fixture
async def client(server: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEYS[0], max_retries=0) as sdk:
        yield sdk


async def respond(client: openai.AsyncOpenAI, text: str, **fields: Any) -> Any:
    return await client.responses.create(model=MODEL, input=text, max_output_tokens=4, temperature=0, **fields)


async def session_of(http: httpx.AsyncClient, session_id: str) -> dict[str, Any]:
    return dict((await http.get(f"/v1/sessions/{session_id}")).json())


async def test_a_chain_is_one_session_and_an_older_turn_forks(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    first = await respond(client, "one")
    second = await respond(client, "two", previous_response_id=first.id)
    third = await respond(client, "three", previous_response_id=second.id)
    chain = await session_of(http, first.id)  # a chain's session is named by its first response
    assert chain["num_chunks"] == 3
    for earlier, later in ((first, second), (second, third)):
        details = later.usage.input_tokens_details
        # Continued on the same engine request: all but the last token sent again is on the device.
        assert details.cached_tokens == earlier.usage.input_tokens + earlier.usage.output_tokens - 1, details
        assert details.computed_tokens == later.usage.input_tokens - details.cached_tokens
    # Continue the first response again: a new session; the chain's is left as it was.
    fork = await respond(client, "again", previous_response_id=first.id)
    assert (await session_of(http, first.id))["num_chunks"] == 3
    transcript = (await http.get(f"/v1/sessions/{first.id}/transcript")).json()["token_ids"]
    sessions = (await http.get("/v1/sessions")).json()["data"]
    forks = [s for s in sessions if s["num_chunks"] == 1 and s["id"] not in (first.id,)]
    fork_transcripts = [(await http.get(f"/v1/sessions/{s['id']}/transcript")).json()["token_ids"] for s in forks]
    first_context = first.usage.input_tokens + first.usage.output_tokens
    # The fork's context starts with the first response's context, token for token.
    assert any(
        t[:first_context] == transcript[:first_context] and len(t) == fork.usage.input_tokens + fork.usage.output_tokens
        for t in fork_transcripts
    )
    # The stored objects: the response, its input items; deleted, it is gone.
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text
    items = [item async for item in client.responses.input_items.list(second.id)]
    assert [item.content[0].text for item in items] == ["two"]
    await client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(second.id)
    # The chain goes on from its latest response.
    fourth = await respond(client, "four", previous_response_id=third.id)
    assert (await session_of(http, first.id))["num_chunks"] == 4 and fourth.status in ("completed", "incomplete")


async def test_a_turn_is_stored_by_its_chunk_when_its_consumer_is_cancelled_right_after_the_commit(
    server: str, client: openai.AsyncOpenAI, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn's durable effects (its stored response, its conversation's items) have one
    owner: the chunk, which writes them after its commit. The window is made certain:
    the server's commit is wrapped so that the stream's consumer (the task the SSE route
    would run) is cancelled the moment the chunk is committed, before it reads the
    result. Oracles: the session (the turn is in it), the stored response over HTTP
    (200, completed, the answer the session holds), and the chain continuing from it on
    the same session (a fork would open a second one). Before the fix the consumer
    stored the response after the event loop, and this answered 404."""
    from app.api.responses.protocol import ResponsesCreateRequest
    from app.api.responses.streaming import response_events
    from app.http.auth import key_owner
    from tests.helpers import RUNNING_APPS

    state = RUNNING_APPS[server].state
    responses, sessions = state.responses_service, state.session_service
    owner = key_owner(API_KEYS[0])
    request = ResponsesCreateRequest.model_validate(
        {"model": MODEL, "input": "one", "max_output_tokens": 4, "temperature": 0, "stream": True}
    )
    pending = await responses.start(owner, request)

    async def consume() -> None:
        async for _event in response_events(responses, owner, pending):
            pass

    consumer = asyncio.create_task(consume())
    commit = sessions.registry.commit

    async def commit_then_lose_the_consumer(*args: Any, **kwargs: Any) -> Any:
        committed = await commit(*args, **kwargs)
        consumer.cancel()
        return committed

    monkeypatch.setattr(sessions.registry, "commit", commit_then_lose_the_consumer)
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await pending.run.released
    monkeypatch.undo()

    session = await session_of(http, pending.session_id)
    assert session["num_chunks"] == 1  # the turn is in the session
    stored = await client.responses.retrieve(pending.id)
    assert stored.status in ("completed", "incomplete") and stored.id == pending.id
    transcript = (await http.get(f"/v1/sessions/{pending.session_id}/transcript")).json()
    assert stored.output_text and clean(stored.output_text) in clean(transcript["text"])
    later = await respond(client, "two", previous_response_id=pending.id)
    assert later.status in ("completed", "incomplete")
    assert (await session_of(http, pending.session_id))["num_chunks"] == 2  # continued, not forked


async def test_a_conversation_keeps_its_items_and_renders_a_deleted_one_away(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, tokenizer: Any
) -> None:
    # A head of several KV blocks (32 tokens here), which a cut keeps.
    head = "hello " * 80
    conversation = await client.conversations.create(items=[{"role": "user", "content": head}], metadata={"topic": "x"})
    assert conversation.metadata == {"topic": "x"}
    first = await respond(client, "one", conversation=conversation.id)
    assert first.conversation is not None and first.conversation.id == conversation.id
    second = await respond(client, "two", conversation={"id": conversation.id})
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - 1
    items = [item async for item in client.conversations.items.list(conversation.id, order="asc")]
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", head),
        ("user", "one"),
        ("assistant", first.output_text),
        ("user", "two"),
        ("assistant", second.output_text),
    ]
    # Delete the first reply: the next response renders the conversation without it and
    # recomputes from where it was; what came before stays cached.
    await client.conversations.items.delete(items[2].id, conversation_id=conversation.id)
    third = await respond(client, "three", conversation=conversation.id)
    details = third.usage.input_tokens_details
    assert 64 <= details.cached_tokens < first.usage.input_tokens, details
    # Oracle: the chat template over the items as they now are (text: a random reply
    # need not re-tokenize to the ids sampled; see test_realtime_conversation.py).
    now = [
        {"role": "user", "content": head},
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "three"},
    ]
    expected = tokenizer.apply_chat_template(
        now, chat_template=tokenizer.chat_template, tokenize=False, add_generation_prompt=True
    )
    transcript = (await http.get(f"/v1/sessions/{conversation.id}/transcript")).json()["token_ids"]
    assert clean(tokenizer.decode(transcript[: third.usage.input_tokens])) == clean(expected)
    updated = await client.conversations.update(conversation.id, metadata={"topic": "y"})
    assert updated.metadata == {"topic": "y"} and (await client.conversations.retrieve(conversation.id)).metadata == {
        "topic": "y"
    }
    added = await client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "later"}])
    assert [i.content[0].text for i in added.data] == ["later"]
    assert (
        await client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)
    ).id == added.data[0].id
    await client.conversations.delete(conversation.id)
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(conversation.id)


async def test_refusals_have_openai_shapes_and_leave_the_chain_usable(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, server: str
) -> None:
    first = await respond(client, "one")
    conversation = await client.conversations.create()
    body = {"model": MODEL, "input": "x", "max_output_tokens": 2}
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"previous_response_id": "resp_unknown"}, 400, "previous_response_not_found"),
        ({"conversation": "conv_unknown"}, 404, "conversation_not_found"),
        ({"previous_response_id": first.id, "conversation": conversation.id}, 400, "mutually_exclusive_parameters"),
        # This server's model (tiny) has no tool-call parser: tools would be rendered and never read.
        (
            {"previous_response_id": first.id, "tools": [{"type": "function", "name": "f", "parameters": {}}]},
            400,
            "unsupported_parameter",
        ),
        ({"previous_response_id": first.id, "tools": [{"type": "web_search"}]}, 400, "unsupported_tool"),
        (
            {"previous_response_id": first.id, "input": [{"type": "reasoning", "id": "rs_1", "summary": []}]},
            400,
            "unsupported_input_item",
        ),
        (
            {"previous_response_id": first.id, "input": [{"type": "function_call_output", "output": "1"}]},
            400,
            "invalid_value",
        ),
        ({"previous_response_id": first.id, "max_output_tokens": 100_000}, 400, "invalid_value"),
        ({"conversation": conversation.id, "stop": ["x"]}, 400, "unsupported_parameter"),
    ]
    for fields, status, code in cases:
        assert_openai_error(await http.post("/v1/responses", json={**body, **fields}), status, code)
    # Refusals that name their parameter, as OpenAI's do: an output that answers no call
    # (a call made in the same input is answered below), another model, sampling out of range.
    named: list[tuple[dict[str, Any], int, str, str]] = [
        (
            {
                "previous_response_id": first.id,
                "input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}],
            },
            400,
            "tool_call_not_found",
            "input",
        ),
        ({"previous_response_id": first.id, "model": "nope"}, 404, "model_not_found", "model"),
        ({"model": "nope"}, 404, "model_not_found", "model"),
        ({"previous_response_id": first.id, "temperature": 5}, 400, "invalid_request", "temperature"),
        ({"conversation": conversation.id, "top_p": 0}, 400, "invalid_request", "top_p"),
        ({"previous_response_id": first.id, "stop_token_ids": [2**70]}, 400, "invalid_request", "stop_token_ids.0"),
    ]
    for fields, status, code, param in named:
        error = assert_openai_error(await http.post("/v1/responses", json={**body, **fields}), status, code)
        assert error["param"] == param and "validation error for" not in error["message"], error
    answered = [
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "1"},
    ]
    assert (await http.post("/v1/responses", json={**body, "input": answered})).status_code == 200
    # vLLM's stateless routes refuse what would continue a conversation (vLLM would drop it).
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    assert_openai_error(
        await http.post("/v1/chat/completions", json={**chat, "conversation": conversation.id}),
        400,
        "unsupported_parameter",
    )
    assert_openai_error(
        await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "previous_response_id": first.id}
        ),
        400,
        "unsupported_parameter",
    )
    malformed = await http.post("/v1/responses", content=b"{not json", headers={"Content-Type": "application/json"})
    assert malformed.status_code == 400, malformed.text
    # Another key's response and conversation do not exist for this one.
    async with httpx.AsyncClient(base_url=server, headers=auth(API_KEYS[1]), timeout=60) as bob:
        assert_openai_error(
            await bob.post("/v1/responses", json={**body, "previous_response_id": first.id}),
            400,
            "previous_response_not_found",
        )
        assert_openai_error(await bob.get(f"/v1/responses/{first.id}"), 404, "response_not_found")
        assert_openai_error(await bob.get(f"/v1/conversations/{conversation.id}"), 404, "conversation_not_found")
        assert_openai_error(
            await bob.post("/v1/responses", json={**body, "conversation": conversation.id}),
            404,
            "conversation_not_found",
        )
    # Nothing above touched the chain or the conversation.
    assert (await session_of(http, first.id))["num_chunks"] == 1
    assert (await http.get(f"/v1/conversations/{conversation.id}/items")).json()["data"] == []
    assert (await respond(client, "two", previous_response_id=first.id)).status in ("completed", "incomplete")
    assert (await respond(client, "hi", conversation=conversation.id)).status in ("completed", "incomplete")


async def test_a_stored_response_is_cached_for_its_own_key_only(server: str) -> None:
    text = " ".join(["amber basalt cobalt"] * 70)  # several 32-token blocks
    body = {"model": MODEL, "input": text, "max_output_tokens": 1, "temperature": 0}
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        cached = []
        for key in (API_KEYS[0], API_KEYS[0], API_KEYS[1]):
            response = await http.post("/v1/responses", json=body, headers=auth(key))
            assert response.status_code == 200, response.text
            cached.append(response.json()["usage"]["input_tokens_details"]["cached_tokens"])
    assert cached[1] >= 192, cached  # the positive control: the same key's second response
    assert cached[2] == 0, cached


async def test_two_turns_at_once_on_a_conversation_get_one_answer_and_one_409(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    conversation = await client.conversations.create()
    long_turn = asyncio.create_task(
        http.post(
            "/v1/responses",
            json={
                "model": MODEL,
                "input": "long",
                "conversation": conversation.id,
                "max_output_tokens": 1000,
                "ignore_eos": True,
            },
        )
    )
    for _ in range(500):
        if (await session_of(http, conversation.id))["status"] == "generating":
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the long turn never started generating")
    second = await http.post(
        "/v1/responses",
        json={"model": MODEL, "input": "short", "conversation": conversation.id, "max_output_tokens": 2},
    )
    assert not long_turn.done(), "the long turn ended before the second was sent: nothing was concurrent"
    assert_openai_error(second, 409, "chunk_in_flight")
    assert (await long_turn).status_code == 200
    items = [item async for item in client.conversations.items.list(conversation.id, order="asc")]
    assert [i.role for i in items] == ["user", "assistant"]  # the refused turn left nothing behind


async def test_the_responses_websocket_chains_steers_and_refuses_in_openais_events(
    server: str, http: httpx.AsyncClient
) -> None:
    """Over ``client.responses.connect()``: two turns chained with ``store: false`` (the
    connection keeps its latest response), a steer while a long answer streams, and bad
    events answered with error events on a connection that stays usable. Every event is
    validated against the SDK's own server-event union, strictly."""
    from openai.types.responses.responses_server_event import ResponsesServerEvent
    from pydantic import TypeAdapter

    server_event: TypeAdapter[Any] = TypeAdapter(ResponsesServerEvent)
    seen: list[Any] = []

    async with (
        openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEYS[0], max_retries=0) as sdk,
        sdk.responses.connect() as connection,
    ):

        async def until(*kinds: str) -> Any:
            while True:
                raw = await connection.recv_bytes()
                event = server_event.validate_json(raw, strict=True)
                seen.append(event)
                assert event.type != "error" or "error" in kinds, event
                if event.type in kinds:
                    return event

        turn = {"type": "response.create", "model": MODEL, "max_output_tokens": 4, "temperature": 0, "store": False}
        await connection.send({**turn, "input": "one"})
        first = (await until("response.completed", "response.incomplete")).response
        await connection.send({**turn, "input": "two", "previous_response_id": first.id})
        second = (await until("response.completed", "response.incomplete")).response
        assert second.previous_response_id == first.id
        assert (
            second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - 1
        )
        with pytest.raises(openai.NotFoundError):  # not stored: only this connection knows it
            await sdk.responses.retrieve(second.id)

        await connection.send({"type": "response.steer", "previous_response_id": second.id, "input": "x"})
        assert (await until("response.steer.failed")).error.code == "response_already_completed"

        # A steer while a long answer streams: it ends steered, and its successor answers.
        await connection.send(
            {**turn, "input": "long", "previous_response_id": second.id, "max_output_tokens": 1000, "ignore_eos": True}
        )
        running = (await until("response.created")).response.id
        await until("response.output_text.delta")
        await connection.send(
            {
                "type": "response.steer",
                "previous_response_id": running,
                "input": [{"role": "user", "content": "now this"}],
            }
        )
        accepted = await until("response.steer.accepted")
        assert accepted.steer.previous_response_id == running
        steered = (await until("response.incomplete", "response.completed")).response
        assert steered.id == running and steered.status == "incomplete", steered
        assert steered.incomplete_details.reason == "steered" and steered.usage.output_tokens < 1000
        successor = (await until("response.created")).response
        assert successor.previous_response_id == running
        done = (await until("response.completed", "response.incomplete")).response
        assert done.id == successor.id
        # The successor continued the steered response's session. A stop ends the engine
        # request (a request cannot resume mid-answer), so the context comes back from the
        # device prefix cache or the CPU tier, in whole blocks (32 tokens in the tests).
        details = done.usage.input_tokens_details
        context = steered.usage.input_tokens + steered.usage.output_tokens
        assert details.cached_tokens >= context // 32 * 32, (details, context)
    chain = await session_of(http, first.id)
    assert chain["num_chunks"] == 4, chain
    # Bad events (raw frames: the SDK sends only valid ones): an error event each, in the
    # SDK's shape, and the connection goes on.
    url = server.replace("http://", "ws://") + "/v1/responses"
    async with websockets.connect(url, additional_headers=auth()) as ws:
        for bad, code in (
            ("{nope", "invalid_json"),
            ('{"type": "session.update"}', "invalid_event"),
            ('{"type": "response.create", "input": "x", "generate": "maybe"}', "invalid_request"),
            ('{"type": "response.create", "input": "x", "stream": true}', "unsupported_parameter"),
            ('{"type": "response.create", "input": "x", "max_output_tokens": "many"}', "invalid_request"),
            (
                '{"type": "response.create", "input": "x", "previous_response_id": "resp_x"}',
                "previous_response_not_found",
            ),
        ):
            await ws.send(bad)
            error = server_event.validate_json(await ws.recv(), strict=True)
            assert error.type == "error" and error.error.code == code, (bad, error)
        await ws.send(
            json.dumps({"type": "response.create", "model": MODEL, "input": "still here", "max_output_tokens": 2})
        )
        while (event := json.loads(await ws.recv()))["type"] not in ("response.completed", "response.incomplete"):
            assert event["type"] != "error", event
    transcript = (await http.get(f"/v1/sessions/{first.id}/transcript")).json()["text"]
    assert clean(transcript).endswith(clean(done.output_text)) and "now this" in transcript


async def test_websocket_lanes_run_side_by_side_in_order_each_and_fork_across(
    server: str, http: httpx.AsyncClient
) -> None:
    """``stream_id`` lanes on one ``/v1/responses`` websocket: a short answer on lane b
    completes while a long one on lane a still streams (side by side); two turns on one
    lane run in order; a lane continues a response made on another (``previous_response_id``
    names the lineage, ``stream_id`` routes); every event echoes its lane; the lanes of a
    connection are bounded. Oracle: the events' order and lanes, and the sessions' chunks."""
    url = server.replace("http://", "ws://") + "/v1/responses"
    turn = {"type": "response.create", "model": MODEL, "temperature": 0, "store": False, "max_output_tokens": 4}
    async with websockets.connect(url, additional_headers=auth()) as ws:
        seen: list[dict[str, Any]] = []

        async def until(kind: str, lane: str) -> dict[str, Any]:
            """The next ``kind`` event of ``lane`` (``ended``: its response's last event)."""
            kinds = ENDED if kind == "ended" else (kind,)
            while True:
                try:
                    event = json.loads(await asyncio.wait_for(ws.recv(), 60))
                except TimeoutError:
                    raise AssertionError(
                        f"no {kind} on lane {lane} in 60 s; seen: "
                        f"{[(e['type'], e.get('stream_id')) for e in seen[-8:]]}"
                    ) from None
                seen.append(event)
                assert event["type"] != "error", event
                if event["type"] in kinds and event.get("stream_id") == lane:
                    return event

        await ws.send(
            json.dumps({**turn, "input": "long", "stream_id": "a", "max_output_tokens": 1000, "ignore_eos": True})
        )
        await until("response.output_text.delta", "a")
        await ws.send(json.dumps({**turn, "input": "short", "stream_id": "b"}))
        await ws.send(json.dumps({**turn, "input": "after it", "stream_id": "b"}))
        short = (await until("ended", "b"))["response"]
        assert not any(e["type"] in ENDED and e.get("stream_id") == "a" for e in seen), "lane b waited for lane a"
        after = (await until("ended", "b"))["response"]
        created = [e["response"]["id"] for e in seen if e["type"] == "response.created" and e["stream_id"] == "b"]
        assert created == [short["id"], after["id"]]  # in order: the second began after the first ended

        def position(kinds: tuple[str, ...], response_id: str) -> int:
            return next(i for i, e in enumerate(seen) if e["type"] in kinds and e["response"]["id"] == response_id)

        assert position(("response.created",), after["id"]) > position(ENDED, short["id"])
        # Lane c continues lane b's latest response (not stored: the connection keeps it).
        await ws.send(json.dumps({**turn, "input": "forked", "stream_id": "c", "previous_response_id": after["id"]}))
        forked = (await until("ended", "c"))["response"]
        assert forked["usage"]["input_tokens_details"]["cached_tokens"] >= after["usage"]["input_tokens"]
        await until("ended", "a")
        assert all("stream_id" in e for e in seen)
        chain = (await http.get(f"/v1/sessions/{after['id']}")).json()
        assert chain["num_chunks"] == 2, chain  # "after it", then lane c's turn: one session

        # Lanes are bounded: 16 per connection (these fail at once: an unknown previous response).
        for index in range(13):
            await ws.send(
                json.dumps({**turn, "input": "x", "stream_id": f"lane-{index}", "previous_response_id": "resp_unknown"})
            )
            error = json.loads(await ws.recv())
            assert (error["error"]["code"], error["stream_id"]) == ("previous_response_not_found", f"lane-{index}")
        await ws.send(json.dumps({**turn, "input": "x", "stream_id": "one-too-many"}))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["error"]["code"] == "too_many_streams", error


async def test_a_warm_up_computes_its_input_and_the_turn_after_it_only_the_assistant_prefix(
    server: str, http: httpx.AsyncClient, client: openai.AsyncOpenAI, tokenizer: Any
) -> None:
    """``generate: false`` over the websocket (a response with no output, its input in the
    session) and over HTTP (stored, continued by id). Oracles: the session's context is
    the chat template over the conversation, the warm-up's input without the assistant
    prefix and the next turn's with it, and nothing else: no token the engine sampled
    after the warm-up (its transcript, token for token); the turn after it finds the
    whole warm-up on the device and computes only what the template adds (its usage)."""

    def rendered(messages: list[dict[str, str]], prefix: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            messages, chat_template=tokenizer.chat_template, tokenize=False, add_generation_prompt=prefix
        )
        return list(tokenizer.encode(text, add_special_tokens=False))

    question = [{"role": "user", "content": "warm me up"}]
    async with (
        openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEYS[0], max_retries=0) as sdk,
        sdk.responses.connect() as connection,
    ):

        async def until_done(warm_up: bool = False) -> Any:
            async for event in connection:
                assert event.type != "error", event
                if warm_up:
                    assert event.type not in ("response.output_item.added", "response.output_text.delta"), event
                if event.type in ("response.completed", "response.incomplete"):
                    return event.response
            raise AssertionError("the connection closed")

        await connection.send(
            {"type": "response.create", "model": MODEL, "input": "warm me up", "store": False, "generate": False}
        )
        warm = await until_done(warm_up=True)
        assert (warm.status, warm.output, warm.usage.output_tokens) == ("completed", [], 0), warm
        assert warm.usage.input_tokens == len(rendered(question, prefix=False))
        await connection.send(
            {
                "type": "response.create",
                "model": MODEL,
                "input": [],
                "store": False,
                "previous_response_id": warm.id,
                "max_output_tokens": 4,
                "temperature": 0,
            }
        )
        answered = await until_done()
    details = answered.usage.input_tokens_details
    prefix = len(rendered(question, prefix=True)) - warm.usage.input_tokens
    assert (details.cached_tokens, details.computed_tokens) == (warm.usage.input_tokens, prefix), details
    transcript = (await http.get(f"/v1/sessions/{warm.id}/transcript")).json()["token_ids"]
    assert transcript[: answered.usage.input_tokens] == rendered(question, prefix=True), transcript
    assert len(transcript) == answered.usage.input_tokens + answered.usage.output_tokens

    # Over HTTP: a stored warm-up (OpenAI's prompt_cache_options.prewarm, which means generate:
    # false), retrieved with no output, continued by a turn with a question.
    warm = await client.responses.create(
        model=MODEL, input="first", extra_body={"prompt_cache_options": {"prewarm": True}}
    )
    assert (await client.responses.retrieve(warm.id)).output == []
    later = await respond(client, "second", previous_response_id=warm.id)
    conversation = [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}]
    transcript = (await http.get(f"/v1/sessions/{warm.id}/transcript")).json()["token_ids"]
    assert transcript[: later.usage.input_tokens] == rendered(conversation, prefix=True)
    assert later.usage.input_tokens_details.cached_tokens == warm.usage.input_tokens


async def test_at_the_session_limit_an_idle_chain_makes_room_and_is_continued_by_a_fork(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, server_settings: Any
) -> None:
    limit = server_settings.max_sessions
    firsts = [await respond(client, f"chain {index}") for index in range(limit + 1)]
    oldest = await session_of(http, firsts[0].id)
    assert (oldest["status"], oldest["close_reason"]) == ("closed", "evicted"), oldest
    assert [(await session_of(http, first.id))["status"] for first in firsts[1:]].count("closed") == 0
    # The evicted chain goes on: a new session replays its context from the store.
    again = await respond(client, "more", previous_response_id=firsts[0].id)
    assert again.usage.input_tokens > firsts[0].usage.input_tokens + firsts[0].usage.output_tokens


async def test_truncation_auto_keeps_a_chain_and_a_conversation_going_past_the_context(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    """Turns of about 700 tokens on a 4,096-token context. With truncation "auto" the
    oldest turns are left out and the chain stays one session (a cut is not a fork); its
    conversation's items stay whole. Without it (the default, "disabled", as at OpenAI)
    the turn that would not fit is refused: the negative control."""
    words = "amber basalt cobalt dune ember fjord granite harbor".split()
    texts = [" ".join(words[(turn + i) % len(words)] for i in range(300)) for turn in range(7)]
    previous, refused_at = None, None
    for turn, text in enumerate(texts):
        reply = await http.post(
            "/v1/responses",
            json={
                "model": MODEL,
                "input": text,
                "max_output_tokens": 4,
                "temperature": 0,
                "previous_response_id": previous,
            },
        )
        if reply.status_code != 200:
            assert_openai_error(reply, 400, "context_length_exceeded")
            refused_at = turn
            break
        previous = reply.json()["id"]
    assert refused_at is not None, "the chain never outgrew the context"
    first = previous = None
    prompts = []
    conversation = await client.conversations.create()
    for text in texts:
        chained = await client.responses.create(
            model=MODEL,
            input=text,
            max_output_tokens=4,
            temperature=0,
            previous_response_id=previous,
            truncation="auto",
        )
        first, previous = first or chained.id, chained.id
        prompts.append(chained.usage.input_tokens)
        on_conversation = await client.responses.create(
            model=MODEL, input=text, max_output_tokens=4, conversation=conversation.id, truncation="auto"
        )
        assert on_conversation.truncation == "auto" and on_conversation.status in ("completed", "incomplete")
    assert prompts[refused_at] < prompts[refused_at - 1] and max(prompts) + 4 <= 4096, (prompts, refused_at)
    assert (await session_of(http, first))["num_chunks"] == len(texts)  # one session: no fork
    items = [item async for item in client.conversations.items.list(conversation.id)]
    assert len(items) == 2 * len(texts)  # every turn's input and reply, the cut ones too
