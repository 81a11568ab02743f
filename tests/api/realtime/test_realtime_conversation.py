"""A Realtime session's context is its conversation: instructions replace one another,
a response's own instructions apply to it only, a re-attach with the same instructions
adds nothing, and a template that rewrites earlier turns (Qwen3's shape) is rendered
again from where it parts from the context.

Oracle: the model's chat template applied to the whole conversation as the client
sent it (its items, the instructions in force, each reply's text), compared as text
with the session's transcript up to the turn's prompt (``usage.input_tokens``). Text,
not token ids: the embedded tiny model's random replies need not re-tokenize to the
ids it sampled; ``<|endoftext|>`` (which it may sample and which no reply text shows) is
left out of both sides, and so is U+FFFD (a random reply cut mid-character).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import websockets

from app.sessions.chat import render_turn
from tests.conftest import auth
from tests.unit.test_chat_turns import GEMMA, MISTRAL, QWEN3

pytestmark = pytest.mark.server

Messages = list[dict[str, str]]


class Connection:
    def __init__(self, ws: Any):
        self.ws = ws
        self.created: dict[str, Any] = {}

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, kind: str) -> dict[str, Any]:
        while (event := json.loads(await self.ws.recv()))["type"] != kind:
            assert event["type"] != "error", event
        return dict(event)

    async def turn(self, text: str, **response: Any) -> dict[str, Any]:
        """One user message and a response to it: the response.done event."""
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        await self.send({"type": "conversation.item.create", "item": item})
        await self.send({"type": "response.create", "response": {"max_output_tokens": 6, **response}})
        return await self.until("response.done")


@contextlib.asynccontextmanager
async def attached(server: str, session_id: str, instructions: str | None = None) -> AsyncIterator[Connection]:
    url = server.replace("http://", "ws://") + f"/v1/realtime?model=embedded-tiny&session_id={session_id}"
    async with websockets.connect(url, additional_headers=auth()) as ws:
        connection = Connection(ws)
        connection.created = await connection.until("session.created")
        if instructions is not None:
            await connection.send(
                {"type": "session.update", "session": {"type": "realtime", "instructions": instructions}}
            )
            await connection.until("session.updated")
        yield connection


def reply_of(done: dict[str, Any]) -> str:
    return str(done["response"]["output"][0]["content"][0]["text"])


class Oracle:
    """The conversation as the client sent it, and the template's text for it."""

    def __init__(self, http: httpx.AsyncClient, tokenizer: Any, session_id: str):
        self.http, self.tokenizer, self.session_id = http, tokenizer, session_id
        self.messages: Messages = []

    @staticmethod
    def clean(text: str) -> str:
        # A reply cut mid-character shows its incomplete last character as nothing in
        # the text the client got, and as U+FFFD in a decode of the context's ids.
        return text.replace("<|endoftext|>", "").replace("\ufffd", "")

    async def check(self, done: dict[str, Any], user: str, instructions: str | None) -> str:
        """The turn's prompt is the template over the conversation with ``instructions``
        at its head; records the reply. Returns the transcript's text."""
        self.messages.append({"role": "user", "content": user})
        head = [{"role": "system", "content": instructions}] if instructions else []
        expected = self.tokenizer.apply_chat_template(
            head + self.messages, chat_template=self.tokenizer.chat_template, tokenize=False, add_generation_prompt=True
        )
        transcript = (await self.http.get(f"/v1/sessions/{self.session_id}/transcript")).json()
        prompt_ids = transcript["token_ids"][: done["response"]["usage"]["input_tokens"]]
        assert self.clean(self.tokenizer.decode(prompt_ids)) == self.clean(expected)
        self.messages.append({"role": "assistant", "content": reply_of(done)})
        return str(transcript["text"])


async def new_session(http: httpx.AsyncClient) -> str:
    created = await http.post("/v1/sessions", json={"defaults": {"temperature": 0, "ignore_eos": True}})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


async def test_instructions_replace_apply_per_response_and_survive_a_reattach(server: str, tokenizer: Any) -> None:
    first, second, own = "Speak like a pirate.", "Answer in one word.", "This answer only: be formal."
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        session_id = await new_session(http)
        oracle = Oracle(http, tokenizer, session_id)
        async with attached(server, session_id, first) as connection:
            await connection.send({"type": "session.update", "session": {"type": "realtime", "max_output_tokens": 5}})
            await connection.until("session.updated")
            await oracle.check(await connection.turn("Hello."), "Hello.", first)
        # The configuration lives with the session: attached again, it is in force.
        async with attached(server, session_id) as connection:
            config = connection.created["session"]
            assert (config["instructions"], config["max_output_tokens"]) == (first, 5), config
        # A re-attach sending the same instructions: the next turn adds only itself.
        async with attached(server, session_id, first) as connection:
            before = (await http.get(f"/v1/sessions/{session_id}/transcript")).json()["token_ids"]
            done = await connection.turn("Again.")
            text = await oracle.check(done, "Again.", first)
            assert text.count(first) == 1, text
            # Only the previous reply's close and the new turn: no system message again.
            turn = render_turn(tokenizer, [{"role": "user", "content": "Again."}], before)
            added = done["response"]["usage"]["input_tokens"] - len(before)
            assert added == len(tokenizer.encode(turn, add_special_tokens=False)), (added, turn)
            # The session's instructions change: they replace the old ones at the head,
            # and the usage shows the conversation recomputed from there.
            await connection.send({"type": "session.update", "session": {"type": "realtime", "instructions": second}})
            await connection.until("session.updated")
            done = await connection.turn("Now?")
            text = await oracle.check(done, "Now?", second)
            assert first not in text and text.count(second) == 1, text
            details = done["response"]["usage"]["input_token_details"]
            assert details["computed_tokens"] > done["response"]["usage"]["input_tokens"] // 2, details
            # A response's own instructions apply to it only.
            done = await connection.turn("Formally?", instructions=own)
            await oracle.check(done, "Formally?", own)
            done = await connection.turn("And back?")
            text = await oracle.check(done, "And back?", second)
            assert own not in text and text.count(second) == 1, text
        await http.delete(f"/v1/sessions/{session_id}")


@contextlib.contextmanager
def chat_template(tokenizer: Any, template: str) -> Iterator[None]:
    before = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        yield
    finally:
        tokenizer.chat_template = before


async def test_a_template_that_rewrites_earlier_turns_holds_a_four_turn_conversation(
    server: str, engine: Any, tokenizer: Any
) -> None:
    """Qwen3's shape (a reply keeps its reasoning block only while no user message
    follows it): every turn after the first re-renders the conversation and continues
    from where it parts from the context, recomputing the last reply's turn only."""
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        session_id = await new_session(http)
        oracle = Oracle(http, tokenizer, session_id)
        with chat_template(tokenizer, QWEN3):
            async with attached(server, session_id) as connection:
                for turn, question in enumerate(["Hi.", "And then?", "Où est Zürich ?", "Bye."]):
                    done = await connection.turn(question)
                    await oracle.check(done, question, None)
                    details = done["response"]["usage"]["input_token_details"]
                    if turn:
                        # Not the whole conversation: the kept prefix came from cache.
                        assert details["cached_tokens"] > 0, details
        await http.delete(f"/v1/sessions/{session_id}")


@pytest.mark.parametrize(
    ("template", "items"),
    [
        (GEMMA, [("system", "Be brief."), ("user", "Hi")]),
        (MISTRAL, [("user", "Hi"), ("user", "again")]),
    ],
    ids=["gemma-system-role", "mistral-alternation"],
)
async def test_a_template_that_refuses_the_conversation_is_an_error_event(
    server: str, tokenizer: Any, template: str, items: list[tuple[str, str]]
) -> None:
    """Gemma's "System role not supported" and Mistral's "roles must alternate" raise in
    the template: the response is refused with an ``error`` event (it closed the
    connection with 1011 before), and the connection and its session stay usable."""
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        session_id = await new_session(http)
        with chat_template(tokenizer, template):
            async with attached(server, session_id) as connection:
                for role, text in items:
                    item = {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}
                    await connection.send({"type": "conversation.item.create", "item": item})
                    await connection.until("conversation.item.done")
                await connection.send({"type": "response.create"})
                error = json.loads(await connection.ws.recv())
                assert error["type"] == "error" and error["error"]["code"] == "template_error", error
                await connection.send({"type": "session.update", "session": {"type": "realtime", "instructions": "x"}})
                await connection.until("session.updated")
        state = (await http.get(f"/v1/sessions/{session_id}")).json()
        assert state["status"] != "closed" and state["num_chunks"] == 0, state
        await http.delete(f"/v1/sessions/{session_id}")


async def test_a_conversation_that_outgrows_the_context_drops_its_oldest_turns(server: str, tokenizer: Any) -> None:
    """Truncation "auto" (OpenAI's Realtime default) on a 4,096-token context, turns of
    about 700 tokens. Oracle: each turn's prompt is the template over the instructions and
    the latest of the client's messages, from a user message on (the same text check as
    above); a cut leaves room, so the turns after it append (their earlier tokens come
    from cache). Negative control: with truncation "disabled" the same turn is refused
    (context_length_exceeded), as every turn was before truncation existed."""
    words = "amber basalt cobalt dune ember fjord granite harbor".split()
    questions = [" ".join(words[(turn + i) % len(words)] for i in range(300)) for turn in range(10)]
    assert all(len(tokenizer.encode(q, add_special_tokens=False)) > 500 for q in questions)
    head = [{"role": "system", "content": "Keep it short."}]
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=120) as http:
        refused_at = None
        session_id = await new_session(http)
        async with attached(server, session_id, "Keep it short.") as connection:
            await connection.send({"type": "session.update", "session": {"type": "realtime", "truncation": "disabled"}})
            assert (await connection.until("session.updated"))["session"]["truncation"] == "disabled"
            for turn, question in enumerate(questions):
                item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]}
                await connection.send({"type": "conversation.item.create", "item": item})
                await connection.until("conversation.item.done")
                await connection.send({"type": "response.create", "response": {"max_output_tokens": 6}})
                event = json.loads(await connection.ws.recv())
                while event["type"] not in ("error", "response.done"):
                    event = json.loads(await connection.ws.recv())
                if event["type"] == "error":
                    assert event["error"]["code"] == "context_length_exceeded", event
                    refused_at = turn
                    break
        assert refused_at is not None and refused_at >= 3, refused_at
        await http.delete(f"/v1/sessions/{session_id}")

        session_id = await new_session(http)
        messages: Messages = []
        prompts, cached = [], []
        async with attached(server, session_id, "Keep it short.") as connection:
            assert connection.created["session"]["truncation"] == "auto"
            for question in questions:
                done = await connection.turn(question)
                assert done["response"]["status"] in ("completed", "incomplete"), done
                messages.append({"role": "user", "content": question})
                usage = done["response"]["usage"]
                transcript = (await http.get(f"/v1/sessions/{session_id}/transcript")).json()
                prompt = Oracle.clean(tokenizer.decode(transcript["token_ids"][: usage["input_tokens"]]))
                kept = [messages[first:] for first in range(len(messages)) if messages[first]["role"] == "user"]
                rendered = [
                    tokenizer.apply_chat_template(
                        head + suffix, chat_template=tokenizer.chat_template, tokenize=False, add_generation_prompt=True
                    )
                    for suffix in kept
                ]
                assert prompt in [Oracle.clean(text) for text in rendered]
                prompts.append(usage["input_tokens"])
                cached.append(usage["input_token_details"]["cached_tokens"])
                messages.append({"role": "assistant", "content": Oracle.clean(reply_of(done))})
        cuts = [turn for turn in range(1, len(prompts)) if prompts[turn] < prompts[turn - 1]]
        assert cuts and cuts[0] == refused_at, (prompts, refused_at)
        assert max(prompts) + 6 <= 4096
        # After a cut, the next turn appends: its earlier tokens come from cache.
        assert any(turn + 1 < len(prompts) and cached[turn + 1] >= prompts[turn] - 32 for turn in cuts), (
            prompts,
            cached,
        )
        await http.delete(f"/v1/sessions/{session_id}")
