"""Helpers shared by the engine-backed tests: drive AsyncLLM directly."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator
from typing import Any

from vllm import SamplingParams
from vllm.engine.protocol import StreamingInput
from vllm.sampling_params import RequestOutputKind

_ids = itertools.count()


def greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def random_tokens(rng: random.Random, count: int, vocab: int = 700) -> list[int]:
    # Ids from 1: id 0 is the embedded tokenizer's end-of-text token.
    return [rng.randrange(1, vocab) for _ in range(count)]


async def run_streaming_session(
    engine: Any, chunks: list[list[int]], max_tokens: int
) -> tuple[list[int], list[list[int]]]:
    """Run one streaming-input session of ``chunks`` and close it.

    Returns the context the engine holds at the end (each chunk's input and its
    output minus the last sampled token, which vLLM discards on resume) and each
    chunk's output tokens."""
    inputs: asyncio.Queue[StreamingInput | None] = asyncio.Queue()
    params = greedy(max_tokens, output_kind=RequestOutputKind.DELTA)
    for chunk in chunks:
        inputs.put_nowait(StreamingInput(prompt={"prompt_token_ids": list(chunk)}, sampling_params=params))
    inputs.put_nowait(None)

    async def feed() -> AsyncIterator[StreamingInput]:
        while (item := await inputs.get()) is not None:
            yield item

    outputs: list[list[int]] = [[]]
    async for out in engine.generate(prompt=feed(), sampling_params=params, request_id=f"session-{next(_ids)}"):
        outputs[-1].extend(out.outputs[0].token_ids)
        if out.outputs[0].finish_reason is not None:
            outputs.append([])
    outputs = [o for o in outputs if o]
    assert len(outputs) == len(chunks), (len(outputs), len(chunks))
    context: list[int] = []
    for chunk, output in zip(chunks, outputs):
        context += chunk + output[:-1]
    return context, outputs


async def generate_once(engine: Any, prompt_ids: list[int], max_tokens: int, recompute: bool = False) -> Any:
    """One greedy request; ``recompute`` forbids every cache (device and CPU tier)."""
    params = greedy(max_tokens, skip_reading_prefix_cache=True if recompute else None)
    final = None
    async for out in engine.generate(
        prompt={"prompt_token_ids": list(prompt_ids)}, sampling_params=params, request_id=f"once-{next(_ids)}"
    ):
        final = out
    assert final is not None and final.finished
    return final


def live_request_ids(engine: Any) -> set[str]:
    """External ids of the requests the engine still tracks (vLLM suffixes its
    internal ids, so the raw keys never equal ours)."""
    return {
        getattr(state, "external_req_id", None) or key
        for key, state in engine.output_processor.request_states.items()
    }


async def wait_until_gone(engine: Any, request_id: str, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if request_id not in live_request_ids(engine):
            return True
        await asyncio.sleep(0.05)
    return False


async def wait_until_closed(http: Any, session_id: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Poll GET /v1/sessions/{id} until the session is closed; return its last state."""
    state: dict[str, Any] = {}
    for _ in range(int(timeout_s / 0.05)):
        state = (await http.get(f"/v1/sessions/{session_id}")).json()
        if state.get("status") == "closed":
            break
        await asyncio.sleep(0.05)
    return state
