"""The seed PR's end-to-end validation, in-process on the real engine and our CPU tier.

A three-chunk streaming session fills the CPU tier. After a reset of the device
prefix cache (the tier is kept), a greedy request on a prefix of the session's
context is served from the tier and must equal a full recompute token for token.

Oracle: a recompute, so the engines run in float32 (the shared test engine's dtype,
tests/conftest.py). In bf16 the session's chunk-by-chunk KV differs in its low bits
from a one-pass prefill and greedy tokens can differ with no bug at all; the bf16
check compares a tier hit with a device hit instead (test_tier_vs_device.py).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.helpers import (
    generate_once,
    random_tokens,
    reset_device_prefix_cache,
    run_streaming_session,
)

pytestmark = pytest.mark.engine

CHUNK_TOKENS = 100
CHUNK_OUTPUT_TOKENS = 8
PROBE_OUTPUT_TOKENS = 32


async def tier_vs_recompute(engine: Any, seed: int, prefix_len: int) -> tuple[Any, Any]:
    rng = random.Random(seed)
    chunks = [random_tokens(rng, CHUNK_TOKENS) for _ in range(3)]
    context, _ = await run_streaming_session(engine, chunks, max_tokens=CHUNK_OUTPUT_TOKENS)
    assert len(context) >= prefix_len
    # Device prefix cache only: the CPU tier keeps what the session offloaded.
    await reset_device_prefix_cache(engine)
    served = await generate_once(engine, context[:prefix_len], PROBE_OUTPUT_TOKENS)
    recomputed = await generate_once(engine, context[:prefix_len], PROBE_OUTPUT_TOKENS, recompute=True)
    assert recomputed.num_cached_tokens == 0
    return served, recomputed


@pytest.mark.parametrize("prefix_len", [192, 160, 288])
async def test_session_prefix_served_from_cpu_tier_equals_recompute(engine: Any, prefix_len: int) -> None:
    served, recomputed = await tier_vs_recompute(engine, seed=prefix_len, prefix_len=prefix_len)
    # The device cache was just reset, so every cached token came from the CPU tier:
    # five blocks at least (a prompt wholly in the tier computes its last token).
    assert served.num_cached_tokens >= 159
    assert list(served.outputs[0].token_ids) == list(recomputed.outputs[0].token_ids)


async def test_negative_control_unfixed_connector_corrupts_the_tier(unfixed_engine: Any) -> None:
    served, recomputed = await tier_vs_recompute(unfixed_engine, seed=192, prefix_len=192)
    assert served.num_cached_tokens >= 159
    # The seed bug: chunk 2 and 3 were stored from chunk 1's blocks.
    assert list(served.outputs[0].token_ids) != list(recomputed.outputs[0].token_ids)
