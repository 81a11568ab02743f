"""The host tier's copy thread: a tier hit's loads run beside the forward pass, and
each attention layer waits for its own pages (connectors/host_tier.py).

In the real engine, every copy on the copy thread is slowed (50 ms each, far longer
than the tiny model's forward pass) and the device KV zeroed before the tier hit, so a
layer that ran before its pages landed would attend over zeros. The tier hit must
still equal the first, computed answer; with the connector's layer waits dropped (the
negative control) it must not.

Oracle: a recompute (the first request computes the whole prompt), so the engine runs
in float32, where a tier hit and a recompute agree token for token.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.conftest import make_settings
from tests.helpers import (
    environment,
    generate_once,
    random_tokens,
    reset_device_prefix_cache,
    started_engine,
)

pytestmark = pytest.mark.engine

PROMPT_TOKENS = 257  # 8 whole blocks in the tier, the 257th token computed
OUTPUT_TOKENS = 8
COPY_DELAY_S = 0.05
TINY_MODEL_LAYERS = 4


@pytest_asyncio.fixture(scope="module")
async def engine_with_copy_thread() -> AsyncIterator[Any]:
    """One engine for both tests, in file order: the negative control drops the
    layer waits for good."""
    # A CPU left to the engine core: the copy thread runs only on a CPU that no
    # compute thread uses (connectors.host_tier.spare_cpus), as in the benchmarks.
    with environment(VLLM_CPU_NUM_OF_RESERVED_CPU="1"):
        # Every load on the thread: the tiny model's are all under the default size for it.
        async with started_engine(make_settings(tier_copy_thread=True, tier_copy_thread_min_load_bytes=0)) as llm:
            yield llm


async def tier_hit_with_slow_copies(engine: Any, seed: int, skip_layer_waits: bool) -> tuple[Any, Any]:
    prompt = random_tokens(random.Random(seed), PROMPT_TOKENS)
    computed = await generate_once(engine, prompt, OUTPUT_TOKENS)
    assert computed.num_cached_tokens == 0
    await generate_once(engine, random_tokens(random.Random(seed + 1), 8), 1)  # one more step: stores land
    await reset_device_prefix_cache(engine)
    await engine.collective_rpc("streamsess_zero_device_kv")
    tensors_waited = await engine.collective_rpc("streamsess_slow_tier_copies", args=(COPY_DELAY_S, skip_layer_waits))
    # The tiny model's 4 layers each wait for their own tensor (0: no copy thread).
    assert tensors_waited == [TINY_MODEL_LAYERS], "layer waits are not per layer"
    from_tier = await generate_once(engine, prompt, OUTPUT_TOKENS)
    assert from_tier.num_cached_tokens == PROMPT_TOKENS - 1  # all from the tier: the device was reset
    return computed, from_tier


async def test_tier_hit_waits_for_each_layers_pages(engine_with_copy_thread: Any) -> None:
    computed, from_tier = await tier_hit_with_slow_copies(engine_with_copy_thread, seed=5, skip_layer_waits=False)
    assert list(from_tier.outputs[0].token_ids) == list(computed.outputs[0].token_ids)


async def test_negative_control_without_layer_waits_layers_read_unloaded_pages(engine_with_copy_thread: Any) -> None:
    computed, from_tier = await tier_hit_with_slow_copies(engine_with_copy_thread, seed=7, skip_layer_waits=True)
    assert list(from_tier.outputs[0].token_ids) != list(computed.outputs[0].token_ids)
