"""vLLM's own OpenAI endpoints, served beside the sessions on the same engine,
driven with the official `openai` SDK."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import API_KEYS

pytestmark = pytest.mark.server


@pytest.fixture
def client(server: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEYS[0], max_retries=0, timeout=120)


async def test_models(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["embedded-tiny"]


async def test_completions_with_usage_and_streaming(client: openai.AsyncOpenAI) -> None:
    # ignore_eos: the reply runs to max_tokens, so its length and finish reason are known.
    completion = await client.completions.create(
        model="embedded-tiny",
        prompt="Streaming input sessions",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert completion.choices[0].finish_reason == "length"
    usage: Any = completion.usage
    assert usage.completion_tokens == 8 and usage.prompt_tokens > 0
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    extra = details.model_extra or {}
    assert extra["device_tokens"] + extra["cpu_tier_tokens"] + extra["computed_tokens"] == usage.prompt_tokens

    stream = await client.completions.create(
        model="embedded-tiny",
        prompt="Streaming input sessions",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text = ""
    final_usage: Any = None
    async for event in stream:
        if event.choices:
            text += event.choices[0].text
        if event.usage is not None:
            final_usage = event.usage
    assert text == completion.choices[0].text
    assert final_usage is not None and final_usage.completion_tokens == usage.completion_tokens
    assert "cpu_tier_tokens" in (final_usage.prompt_tokens_details.model_extra or {})


async def test_chat_completions(client: openai.AsyncOpenAI) -> None:
    chat = await client.chat.completions.create(
        model="embedded-tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    stream = await client.chat.completions.create(
        model="embedded-tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = []
    usage = None
    async for event in stream:
        if event.choices and event.choices[0].delta.content:
            pieces.append(event.choices[0].delta.content)
        usage = event.usage or usage
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens  # type: ignore[union-attr]


async def test_openai_errors_keep_the_shape(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert missing.value.status_code == 404
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()


async def test_metrics_expose_ours_and_vllms(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        text = (await http.get("/metrics")).text
    for name in (
        "vllm:prompt_tokens",
        "vllm:prefix_cache_hits",
        "streamsess_sessions_open",
        "streamsess_sessions_created_total",
        "streamsess_chunks_total",
        "streamsess_chunk_time_to_first_token_seconds_bucket",
        "streamsess_chunk_prompt_tokens_total",
    ):
        assert name in text, name
