"""The OpenAI Agents SDK, unmodified, against a running server (run by scripts/agents-sdk-check,
in a venv of its own: the SDK pins its own openai).

Three two-turn agents: one chained by ``previous_response_id``, one on a conversation
(``conversation_id``), one with ``OpenAIConversationsSession``; each second turn's input
mostly cached. Then a ``@function_tool`` with ``tool_choice="required"`` through the SDK's
chat completions model (vLLM's route) and its Responses model chained by
``previous_response_id`` (our sessions): the tool is called with valid JSON arguments, its
output goes back, the agent answers, and (Responses) the round after the call computes
only the tool's output and the turn's framing. Exits non-zero if any of it fails.

On an AMX CPU, or an AVX-512-BF16 CPU without AMX (where vLLM's packed linear kernel runs),
run it against a float32 server (STREAMSESS_DTYPE=float32 ./scripts/serve): in bf16 there
the default model's greedy answer to a second turn loops until max_tokens, and the SDK
fails on the `incomplete` response.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIConversationsSession,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

BASE = os.environ.get("STREAMSESS_BASE_URL", "http://127.0.0.1:8000")
MODEL = os.environ.get("STREAMSESS_MODEL", "smollm2-135m-instruct")


async def main() -> int:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{BASE}/v1", api_key=os.environ.get("STREAMSESS_API_KEY", "unused"))
    # Room for the model to end its answer: a response cut at max_output_tokens is
    # `incomplete`, which the SDK treats as a failure (as it does at OpenAI).
    agent = Agent(
        name="assistant",
        instructions="You are a helpful assistant. Answer briefly.",
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=400),
    )
    failures = 0

    def report(label: str, first: object, second: object) -> None:
        nonlocal failures
        details = second.context_wrapper.usage.input_tokens_details  # type: ignore[attr-defined]
        usage = second.context_wrapper.usage  # type: ignore[attr-defined]
        print(
            f"{label}: {first.final_output!r} | {second.final_output!r} | "  # type: ignore[attr-defined]
            f"turn 2: {details.cached_tokens} of {usage.input_tokens} input tokens cached"
        )
        failures += details.cached_tokens == 0

    first = await Runner.run(agent, "My name is Ana. What is the capital of France?")
    second = await Runner.run(agent, "What is my name?", previous_response_id=first.last_response_id)
    report("previous_response_id", first, second)

    conversation = await client.conversations.create()
    first = await Runner.run(agent, "My name is Ana.", conversation_id=conversation.id)
    second = await Runner.run(agent, "What is my name?", conversation_id=conversation.id)
    report("conversation_id", first, second)

    session = OpenAIConversationsSession(openai_client=client)
    first = await Runner.run(agent, "My name is Ana.", session=session)
    second = await Runner.run(agent, "What is my name?", session=session)
    report("OpenAIConversationsSession", first, second)
    items = await session.get_items()
    await session.pop_item()  # the SDK's undo: deletes the conversation's last item
    assert len(await session.get_items()) == len(items) - 1
    return failures + await tool_agents(client)


async def tool_agents(client: AsyncOpenAI) -> int:
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"The weather in {city} is sunny, 21 C."

    failures = 0
    models = {
        "chat completions": OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        "responses, previous_response_id": OpenAIResponsesModel(model=MODEL, openai_client=client),
    }
    for label, model in models.items():
        calls.clear()
        # The SDK sets tool_choice back to auto once the tool has run (reset_tool_choice).
        agent = Agent(
            name="weather",
            instructions="Answer with the tool's result.",
            tools=[get_weather],
            model=model,
            model_settings=ModelSettings(temperature=0, max_tokens=200, tool_choice="required"),
        )
        result = await Runner.run(agent, "What is the weather in Paris?", auto_previous_response_id=True)
        responses = result.raw_responses
        after_call = responses[1].usage if len(responses) > 1 else None
        details = after_call.input_tokens_details if after_call else None
        print(
            f"tools over {label}: called with {calls!r}, answered {result.final_output!r}; round 2: "
            f"{details.cached_tokens if details else '-'} of {after_call.input_tokens if after_call else '-'} "
            "input tokens cached"
        )
        failures += not calls or not result.final_output or after_call is None or not details.cached_tokens
    return failures + await realtime_tool_agent(get_weather, calls)


async def realtime_tool_agent(tool: object, calls: list[str]) -> int:
    """The SDK's Realtime agent (text) with the same tool: called once (required), then
    answered (tool_choice back to auto, as the SDK's other runners do after a call)."""
    from agents.realtime import RealtimeAgent, RealtimeRunner
    from agents.realtime.model_inputs import RealtimeModelSendSessionUpdate

    calls.clear()
    agent = RealtimeAgent(name="weather", instructions="Answer with the tool's result.", tools=[tool])
    settings: Any = {"model_name": MODEL, "output_modalities": ["text"], "tool_choice": "required"}
    runner = RealtimeRunner(agent, config={"model_settings": settings})
    url = BASE.replace("http", "ws", 1) + f"/v1/realtime?model={MODEL}"
    session = await runner.run(
        model_config={
            "url": url,
            "api_key": os.environ.get("STREAMSESS_API_KEY", "unused"),
            "initial_model_settings": settings,
        }
    )
    answer, after_call = "", None
    async with session:
        await session.send_message("What is the weather in Paris?")
        async for event in session:
            if event.type == "tool_end":
                # The SDK sends its whole session config again: text output and tools included.
                await session.model.send_event(
                    RealtimeModelSendSessionUpdate(
                        session_settings={**settings, "tool_choice": "auto", "tools": [tool]}
                    )
                )
            elif event.type == "raw_model_event" and event.data.type == "raw_server_event":
                raw = event.data.data
                if raw.get("type") == "response.done" and raw["response"]["output"][0]["type"] == "message":
                    after_call = raw["response"].get("usage")  # the round after the call
                    texts = [
                        part.get("text", "")
                        for item in raw["response"]["output"]
                        if item["type"] == "message"
                        for part in item.get("content", [])
                    ]
                    answer = "".join(texts)
                    if answer:
                        break
            elif event.type == "error":
                print(f"realtime error: {event.error}")
                break
    cached = (after_call or {}).get("input_token_details", {}).get("cached_tokens", 0)
    print(
        f"tools over realtime: called with {calls!r}, answered {answer!r}; round 2: {cached} of "
        f"{(after_call or {}).get('input_tokens', '-')} input tokens cached"
    )
    return int(not calls or not answer or not cached)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
