"""bf16: a prefix served from the CPU tier is the prefix the session computed.

Oracles, and why these and not a recompute:

- In bf16 a session's KV (computed chunk by chunk, its output tokens one decode
  step at a time) differs in its low bits from the same tokens prefilled in one
  pass, and greedy decoding on random weights turns that into other tokens. So in
  bf16 a tier hit is compared with a *device* hit: the same prefix served from the
  device prefix cache, which holds the session's own KV. The fp32 checks against a
  recompute live in test_seed_e2e.py and the harness.
- **Byte-exact pages.** The KV pages the tier stored are the session's pages, and
  the pages a tier hit loads into the device are those pages again, compared by
  digest with no tolerance (tests/kv_inspector.py reads them inside the worker).
- The prefixes end mid-block. On a block boundary the two paths differ by design:
  the device prefix cache returns every block but the last (vLLM must compute at
  least one token, so it recomputes the whole last block), while a tier hit returns
  every block and vLLM recomputes only the last token; in bf16 those differ.

- **The randomized harness** (tests/correctness/harness.py) with the same oracle:
  its prefix probes are served once from the device and once from the tier.

Each check runs under every CPU attention kernel this machine has (AMX and the
kernel vLLM picks without it, on an AMX CPU), and once with the streaming fix off,
where every one of them must catch the seed bug. All run on one engine per case.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.correctness.harness import (
    SUITE_SEED,
    InProcessHarness,
    harness_settings,
    run_workload,
    workload_for,
)
from tests.helpers import (
    ATTENTION_KERNELS,
    EngineSession,
    generate_once,
    random_tokens,
    reset_device_prefix_cache,
)

pytestmark = pytest.mark.engine

BLOCK = 32
CHUNK_TOKENS = 100
CHUNK_OUTPUT_TOKENS = 8
PROBE_OUTPUT_TOKENS = 32
SEEDS = (1, 2, 3, 4)
# Mid-block, and past the 128 tokens up to which the seed bug still served right KV.
PREFIXES = (176, 208, 272)
# Sessions of the randomized harness workload run after the comparisons.
HARNESS_SESSIONS = 14


@dataclass
class Comparison:
    stored_blocks: int = 0
    stored_blocks_missing_from_tier: int = 0
    loaded_blocks: int = 0
    loaded_blocks_differing: int = 0
    probes: int = 0
    token_mismatches: list[tuple[int, int]] = field(default_factory=list)


async def one_worker(engine: Any, method: str, *args: Any) -> Any:
    (result,) = await engine.collective_rpc(method, args=args)
    return result


async def compare_tier_with_device(engine: Any, seed: int, report: Comparison) -> None:
    rng = random.Random(seed)
    session = EngineSession(engine, CHUNK_OUTPUT_TOKENS)
    for _ in range(3):
        await session.send(random_tokens(rng, CHUNK_TOKENS))
    # Idle session: its blocks are on the device. The tier holds every full block
    # of what is prompt so far; the last chunk's outputs are not prompt yet.
    session_pages = await one_worker(engine, "streamsess_request_block_digests", session.internal_request_id())
    tier_pages = set(await one_worker(engine, "streamsess_host_tier_digests"))
    stored = (len(session.context) - (len(session.outputs[-1]) - 1)) // BLOCK
    report.stored_blocks += stored
    report.stored_blocks_missing_from_tier += sum(page not in tier_pages for page in session_pages[:stored])
    context = session.context
    await session.close()

    # The device prefix cache still holds the closed session's blocks: device hits.
    device = {n: await generate_once(engine, context[:n], PROBE_OUTPUT_TOKENS) for n in PREFIXES}
    tier = {}
    for n in PREFIXES:
        assert device[n].num_cached_tokens == n // BLOCK * BLOCK, "expected a full device hit"
        # Device cache only: the CPU tier keeps what the session offloaded.
        await reset_device_prefix_cache(engine)
        tier[n] = await generate_once(engine, context[:n], PROBE_OUTPUT_TOKENS)
        assert tier[n].num_cached_tokens == n // BLOCK * BLOCK, "expected a full CPU-tier hit"
        report.probes += 1
        if list(tier[n].outputs[0].token_ids) != list(device[n].outputs[0].token_ids):
            report.token_mismatches.append((seed, n))

    # The pages a tier hit loads: a new session whose first chunk is the longest
    # prefix, looked at while it is idle, against the pages the session computed.
    await reset_device_prefix_cache(engine)
    longest = max(PREFIXES)
    probe = EngineSession(engine, 1)
    await probe.send(context[:longest])
    loaded_pages = await one_worker(engine, "streamsess_request_block_digests", probe.internal_request_id())
    await probe.close()
    loaded = longest // BLOCK
    report.loaded_blocks += loaded
    report.loaded_blocks_differing += sum(a != b for a, b in zip(loaded_pages[:loaded], session_pages[:loaded]))


@pytest.mark.parametrize("fix", [True, False], ids=["fixed", "negative-control-unfixed"])
@pytest.mark.parametrize("attention", ATTENTION_KERNELS)
async def test_tier_hit_is_the_session_kv_in_bf16(attention: str, fix: bool) -> None:
    """Both bf16 oracles on one engine (the harness's bpc1 settings in bf16): the
    comparisons above first, on a fresh engine, then the randomized harness workload
    with its tier-against-device probes."""
    settings = harness_settings("bpc1", oracle="device", disable_streaming_session_fix=not fix)
    harness = InProcessHarness(settings, attention)
    async with harness as backend:
        print(f"bf16 tier-vs-device, {attention=}: attention kernels {harness.kernels}, fix {'on' if fix else 'off'}")
        report = Comparison()
        for seed in SEEDS:
            await compare_tier_with_device(harness.engine, seed, report)
        workload = await run_workload(backend, workload_for(settings, SUITE_SEED, HARNESS_SESSIONS))
    summary = workload.summary()
    assert report.stored_blocks > 0 and report.loaded_blocks > 0 and report.probes == len(SEEDS) * len(PREFIXES)
    # Enough harness probes that both paths served in full, or the run proves nothing.
    assert workload.prefix_requests_compared >= HARNESS_SESSIONS // 2, summary
    if fix:
        assert report.stored_blocks_missing_from_tier == 0, report
        assert report.loaded_blocks_differing == 0, report
        assert report.token_mismatches == [], report
        assert workload.passed, summary
        assert workload.leftover_requests == [], summary
    else:
        # The seed bug stored later chunks' keys with earlier chunks' pages: every
        # oracle must see it.
        assert report.stored_blocks_missing_from_tier > 0, report
        assert report.loaded_blocks_differing > 0, report
        assert report.token_mismatches, report
        assert any(m.kind == "prefix" for m in workload.failures), summary
