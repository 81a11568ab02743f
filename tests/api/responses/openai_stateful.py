"""OpenAI's stateful APIs against a server on the real default model, through the
official ``openai`` SDK (run by test_fresh_server's float32 server: no engine of its own).

Oracles, at every turn, greedy in float32:
- the answer is /v1/chat/completions' on the whole conversation so far, salted so that
  it recomputes (it cannot read the session's cache);
- the session's context is the model's chat template applied to that conversation
  (text; and token for token while every reply re-tokenizes to the ids the model
  sampled: where one does not, chat completions' prompt differs from the session's
  from there, the answers may differ, and the check says so and compares text only);
- from turn 2 on, the prompt's computed tokens are the new input and the turn's
  framing, not the history: ``usage.input_tokens_details`` shows the rest cached.
"""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import openai

MODEL = "smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?",
    "And of Germany?",
    "Name one river there.",
    "Thank you!",
    "What is two plus two?",
    "Say it in French.",
    "Name a color.",
    "What did I ask first?",
]
MAX_OUTPUT = 24


class ConversationCheck:
    def __init__(self, base_url: str, tokenizer: Any, label: str) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=300)
        self.tokenizer, self.label = tokenizer, label
        self.messages: list[dict[str, str]] = []
        self.canonical = True

    def reference(self, messages: list[dict[str, str]]) -> str:
        answer = self.http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": messages,
                "max_tokens": MAX_OUTPUT,
                "temperature": 0,
                "cache_salt": secrets.token_hex(8),
            },
        )
        assert answer.status_code == 200, answer.text
        return str(answer.json()["choices"][0]["message"]["content"])

    def turn(self, question: str, response: Any, session_id: str, history_tokens: int, longer: bool = False) -> None:
        """Check one response: its answer, its session's context, its usage. ``longer``:
        the response ran past MAX_OUTPUT (ignore_eos): the reference is its beginning."""
        self.messages.append({"role": "user", "content": question})
        expected = self.reference(self.messages)
        if self.canonical:
            answer = response.output_text[: len(expected)] if longer else response.output_text
            assert answer == expected, (self.label, len(self.messages), response.output_text, expected)
        self.messages.append({"role": "assistant", "content": response.output_text})
        transcript = self.http.get(f"/v1/sessions/{session_id}/transcript").json()["token_ids"]
        from app.sessions.chat import reply_close

        closed = transcript + self.tokenizer.encode(
            reply_close(self.tokenizer, transcript[-1]), add_special_tokens=False
        )
        rendered = self.tokenizer.apply_chat_template(self.messages, tokenize=False)
        assert self.tokenizer.decode(closed) == rendered, (self.label, self.tokenizer.decode(closed), rendered)
        self.canonical = self.canonical and closed == self.tokenizer.encode(rendered, add_special_tokens=False)
        details = response.usage.input_tokens_details
        if history_tokens:
            # The history is cached; computed: this turn's question and framing only.
            assert details.cached_tokens >= history_tokens - 1, (self.label, details, history_tokens)
            assert details.computed_tokens == response.usage.input_tokens - details.cached_tokens
            assert details.computed_tokens <= len(self.tokenizer.encode(question)) + 12, (self.label, details)


def check_stateful_apis(base_url: str, tokenizer: Any) -> dict[str, bool]:
    """An 8-turn chat three ways (a conversation, a previous_response_id chain, the chain
    streamed), and a fork of the chain at turn 3. Returns whether each stayed token-exact."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    results: dict[str, bool] = {}

    conversation = client.conversations.create(metadata={"test": "stateful"})
    check = ConversationCheck(base_url, tokenizer, "conversation")
    history = 0
    for question in QUESTIONS:
        response = client.responses.create(
            model=MODEL, input=question, conversation=conversation.id, max_output_tokens=MAX_OUTPUT, temperature=0
        )
        assert response.conversation is not None and response.conversation.id == conversation.id
        check.turn(question, response, conversation.id, history)
        history = response.usage.input_tokens + response.usage.output_tokens
    items = list(client.conversations.items.list(conversation.id, order="asc"))
    assert [(i.role, i.content[0].text) for i in items] == [(m["role"], m["content"]) for m in check.messages]
    results["conversation"] = check.canonical

    check = ConversationCheck(base_url, tokenizer, "chain")
    previous: str | None = None
    chain: list[Any] = []
    history = 0
    for question in QUESTIONS:
        response = client.responses.create(
            model=MODEL, input=question, previous_response_id=previous, max_output_tokens=MAX_OUTPUT, temperature=0
        )
        check.turn(question, response, chain[0].id if chain else response.id, history)
        chain.append(response)
        previous, history = response.id, response.usage.input_tokens + response.usage.output_tokens
    results["chain"] = check.canonical

    # Turn 3 continued again: a new session whose context is turns 1-3, from the cache.
    fork_question = "Name a mountain there."
    fork = client.responses.create(
        model=MODEL, input=fork_question, previous_response_id=chain[2].id, max_output_tokens=MAX_OUTPUT, temperature=0
    )
    history = chain[2].usage.input_tokens + chain[2].usage.output_tokens
    check = ConversationCheck(base_url, tokenizer, "fork")
    check.messages = [
        m
        for q, r in zip(QUESTIONS[:3], chain[:3], strict=True)
        for m in ({"role": "user", "content": q}, {"role": "assistant", "content": r.output_text})
    ]
    expected = check.reference([*check.messages, {"role": "user", "content": fork_question}])
    if results["chain"]:
        assert fork.output_text == expected, (fork.output_text, expected)
    # Whole blocks of the kept prefix come from the device cache, but the last full one:
    # vLLM 0.32 does not cache a request's last block of generated tokens (its own
    # /v1/completions shows the same: 32 of a 12 + 40-token prompt-and-answer cached).
    block = 16
    assert fork.usage.input_tokens_details.cached_tokens >= (history // block - 1) * block, (fork.usage, history)

    check = ConversationCheck(base_url, tokenizer, "streamed chain")
    previous, history, first = None, 0, None
    for question in QUESTIONS:
        with client.responses.stream(
            model=MODEL, input=question, previous_response_id=previous, max_output_tokens=MAX_OUTPUT, temperature=0
        ) as stream:
            events = list(stream)
        # An answer cut at max_output_tokens ends with response.incomplete, as at OpenAI.
        assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
        response = events[-1].response
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
        first = first or response.id
        check.turn(question, response, first, history)
        previous, history = response.id, response.usage.input_tokens + response.usage.output_tokens
    results["streamed"] = check.canonical
    results["websocket"] = _over_the_websocket(client, base_url, tokenizer)
    return results


def _over_the_websocket(client: openai.OpenAI, base_url: str, tokenizer: Any) -> bool:
    """The chain over ``client.responses.connect()`` (``store: false``: the connection keeps
    its latest response; its third question sent with ``generate: false`` and answered by
    the turn after it, which is checked as any other), then a steer while a long answer streams: it ends ``steered``,
    its successor answers the steered input, and the session's context is the template's
    rendering of the conversation with the steered answer as far as it went."""
    check = ConversationCheck(base_url, tokenizer, "websocket")
    previous: str | None = None
    first, history = None, 0
    with client.responses.connect() as connection:

        def until(*kinds: str) -> Any:
            for event in connection:
                assert event.type != "error", event
                if event.type in kinds:
                    return event
            raise AssertionError("the connection closed")

        for number, question in enumerate(QUESTIONS):
            turn = {
                "type": "response.create",
                "model": MODEL,
                "store": False,
                "previous_response_id": previous,
                "max_output_tokens": MAX_OUTPUT,
                "temperature": 0,
            }
            if number == 2:
                # generate: false: the question computed now, answered by the next turn (no input of its
                # own), which computes only the assistant prefix.
                connection.send({**turn, "input": question, "generate": False})
                warm = until("response.completed").response
                assert (warm.output, warm.usage.output_tokens) == ([], 0), warm
                connection.send({**turn, "input": [], "previous_response_id": warm.id})
            else:
                connection.send({**turn, "input": question})
            response = until("response.completed", "response.incomplete").response
            first = first or response.id
            check.turn(question, response, first, history)
            if number == 2:
                details = response.usage.input_tokens_details
                assert details.cached_tokens == warm.usage.input_tokens, (details, warm.usage)
                prefix = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
                assert details.computed_tokens == len(prefix), details
            previous, history = response.id, response.usage.input_tokens + response.usage.output_tokens
        long_question, steer = "Write a long story about a dragon.", "Stop. What is the capital of Spain?"
        connection.send(
            {
                "type": "response.create",
                "model": MODEL,
                "input": long_question,
                "store": False,
                "previous_response_id": previous,
                "max_output_tokens": 400,
                "temperature": 0,
            }
        )
        running = until("response.created").response.id
        for _ in range(8):
            until("response.output_text.delta")
        connection.send({"type": "response.steer", "previous_response_id": running, "input": steer})
        assert until("response.steer.accepted").steer.previous_response_id == running
        steered = until("response.incomplete", "response.completed").response
        assert steered.incomplete_details is not None and steered.incomplete_details.reason == "steered", steered
        successor = until("response.created").response
        assert successor.previous_response_id == running
        done = until("response.completed", "response.incomplete").response
    # The context: the conversation with the steered answer as far as it went, the steer, the answer.
    check.messages += [
        {"role": "user", "content": long_question},
        {"role": "assistant", "content": steered.output_text},
    ]
    check.turn(steer, done, first, 0, longer=True)  # the successor inherits max_output_tokens
    return check.canonical
