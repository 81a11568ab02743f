"""The OpenAI Agents SDK, unmodified, against a running server (run by scripts/agents-sdk-check,
in a venv of its own: the SDK pins its own openai).

Three two-turn agents: one chained by ``previous_response_id``, one on a conversation
(``conversation_id``), one with ``OpenAIConversationsSession``; each second turn's input
mostly cached. Exits non-zero if any turn fails or a second turn finds nothing cached.
"""

from __future__ import annotations

import asyncio
import os
import sys

from agents import Agent, ModelSettings, OpenAIConversationsSession, OpenAIResponsesModel, Runner
from agents import set_tracing_disabled
from openai import AsyncOpenAI

BASE = os.environ.get("STREAMSESS_BASE_URL", "http://127.0.0.1:8000")
MODEL = os.environ.get("STREAMSESS_MODEL", "smollm2-135m-instruct")


async def main() -> int:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{BASE}/v1", api_key=os.environ.get("STREAMSESS_API_KEY", "unused"))
    # Room for the model to end its answer: a response cut at max_output_tokens is
    # `incomplete`, which the SDK treats as a failure (as it does at OpenAI).
    agent = Agent(name="assistant", instructions="You are a helpful assistant. Answer briefly.",
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=400))
    failures = 0

    def report(label: str, first: object, second: object) -> None:
        nonlocal failures
        details = second.context_wrapper.usage.input_tokens_details  # type: ignore[attr-defined]
        usage = second.context_wrapper.usage  # type: ignore[attr-defined]
        print(f"{label}: {first.final_output!r} | {second.final_output!r} | "  # type: ignore[attr-defined]
              f"turn 2: {details.cached_tokens} of {usage.input_tokens} input tokens cached")
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
    return failures


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
