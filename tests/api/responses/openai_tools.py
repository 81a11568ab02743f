"""A tool round trip over the Responses API on the real default model, through the
official ``openai`` SDK (run by test_fresh_server's float32 server: no engine of its own).

Oracles, greedy in float32:
- the call: /v1/chat/completions on the same conversation, tools and tool_choice
  (vLLM's own route, the same grammar), salted so that it recomputes: the same
  function and arguments;
- the session's context is the model's chat template applied to the whole
  conversation with its tools (the call's arguments as the model wrote them), as text;
- the call's opening, which the grammar forces, is the end of the turn's input (prefilled);
- the round after the call computes only the tool's output and the turn's framing:
  ``usage.input_tokens_details`` shows the rest cached;
- its answer is a salted recompute of the session's own context (/v1/completions on its
  token ids), and chat completions' on the whole conversation where the context is
  also the template's rendering token for token (the model writes a call's JSON in
  tokens that re-tokenizing its text may merge: then chat completions' prompt differs).

Negative control (run when written: a server whose replies keep the arguments as vLLM's
parser re-serializes them, ``app.tools.parsing._as_written`` replaced by the identity):
the context check fails at the first call, the model's own ``{\n    "city": ...}``
against the conversation's ``{"city": ...}``.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import httpx
import openai
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

from app.sessions.chat import reply_close

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
QUESTION = "What is the weather in Paris?"
TOOL_OUTPUT = "Sunny, 21 C, light wind from the west."


def check_tool_round_trip(base_url: str, tokenizer: Any) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    http = httpx.Client(base_url=base_url, timeout=300)

    def reference(messages: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any]:
        answer = http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": messages,
                "tools": CHAT_TOOLS,
                "tool_choice": tool_choice,
                "max_tokens": 60,
                "temperature": 0,
                "cache_salt": secrets.token_hex(8),
            },
        )
        assert answer.status_code == 200, answer.text
        return dict(answer.json()["choices"][0]["message"])

    def render(messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        # The tools as vLLM's chat completions renders them (its request model, dumped).
        tools = [ChatCompletionToolsParam.model_validate(tool).model_dump() for tool in CHAT_TOOLS]
        return str(
            tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )
        )

    def context_is(messages: list[dict[str, Any]], session_id: str) -> tuple[list[int], bool]:
        """The session's transcript; asserts it renders the conversation, and tells
        whether it is also the rendering's tokens."""
        transcript = http.get(f"/v1/sessions/{session_id}/transcript").json()["token_ids"]
        closed = transcript + tokenizer.encode(reply_close(tokenizer, transcript[-1]), add_special_tokens=False)
        rendered = render(messages)
        assert tokenizer.decode(closed) == rendered, (tokenizer.decode(closed), rendered)
        return transcript, closed == tokenizer.encode(rendered, add_special_tokens=False)

    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    first = client.responses.create(
        model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required", max_output_tokens=60, temperature=0
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    call = calls[0]
    expected = reference(messages, "required")["tool_calls"][0]["function"]
    assert (call.name, json.loads(call.arguments)) == (expected["name"], json.loads(expected["arguments"]))
    messages.append(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        }
    )
    transcript, _ = context_is(messages, first.id)
    # The call's opening (what the grammar forces) was prefilled with the turn, not
    # decoded (app/tools/opening.py): the input ends with it. Fails with it decoded: the
    # input then ends with the template's assistant prefix.
    opening = tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments":', add_special_tokens=False)
    assert transcript[first.usage.input_tokens - len(opening) : first.usage.input_tokens] == opening, first.usage

    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_OUTPUT}],
        max_output_tokens=60,
        temperature=0,
    )
    details = second.usage.input_tokens_details
    history = first.usage.input_tokens + first.usage.output_tokens
    assert details.cached_tokens >= history - 1, (second.usage, history)
    # Computed: the tool's output in the template's framing (the text the template adds
    # for it and the next assistant prefix), the close of the reply before it (its
    # newline after <|im_end|>) and the one history token vLLM leaves uncached.
    tool_message = {"role": "tool", "tool_call_id": call.call_id, "content": TOOL_OUTPUT}
    before = render(messages)
    framed = render([*messages, tool_message], generation_prompt=True)[len(before) :]
    assert details.computed_tokens <= len(tokenizer.encode(framed, add_special_tokens=False)) + 2, (
        second.usage,
        framed,
    )
    messages.append(tool_message)
    assert [item.type for item in second.output] == ["message"], second.output  # it answers in words here
    transcript, canonical = context_is([*messages, {"role": "assistant", "content": second.output_text}], first.id)
    prompt = transcript[: len(transcript) - second.usage.output_tokens]
    recompute = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 60, "temperature": 0, "cache_salt": secrets.token_hex(8)},
    )
    assert recompute.status_code == 200, recompute.text
    assert second.output_text == recompute.json()["choices"][0]["text"], (second.output_text, recompute.json())
    if canonical:
        assert second.output_text == reference(messages, "auto")["content"]
    print(f"tool round trip: the context is the template's tokens too: {canonical}")
