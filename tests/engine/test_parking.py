"""Parked sessions, on the real engine through SessionService (no HTTP).

A parked session has no engine request; its next chunk resumes it from its
transcript, with the prefix from the device prefix cache or the CPU tier.

Oracles: the engines here run in float32, so a resumed chunk's answer is compared
token for token with the same session never parked and with a recompute (sound in
fp32 only; see test_tier_vs_device.py for bf16). Capacity tests count errors and
parks, and assert no request waits unboundedly.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from app.errors import APIError
from app.metrics import session_metrics
from app.protocol import SamplingOptions, SessionCreateRequest, SessionDefaults
from app.sessions.admission import DeviceCapacity
from app.sessions.chunk import ChunkResult
from app.sessions.inputs import Turn
from app.sessions.service import SessionService
from app.sessions.session import StreamingSession
from app.wiring import session_service
from tests.conftest import make_settings
from tests.helpers import (
    generate_once,
    live_request_ids,
    random_tokens,
    reset_device_prefix_cache,
    started_engine,
    until,
)

pytestmark = pytest.mark.engine

BLOCK = 32
OWNER = "owner"


def make_service(engine: Any, **overrides: Any) -> SessionService:
    return session_service(engine, make_settings(**overrides))


async def open_session(service: SessionService) -> StreamingSession:
    defaults = SessionDefaults(temperature=0.0, ignore_eos=True)
    return await service.create(OWNER, SessionCreateRequest(defaults=defaults))


async def send(service: SessionService, session: StreamingSession, ids: list[int], max_tokens: int) -> ChunkResult:
    run = await service.start_chunk(
        OWNER, session.id, ids, SamplingOptions(max_tokens=max_tokens), transport="test", wait=True
    )
    return await run.result()


def counter(metric: Any, label: str) -> float:
    return float(metric.labels(label)._value.get())


@pytest_asyncio.fixture
async def service(engine: Any) -> AsyncIterator[SessionService]:
    svc = make_service(engine)
    await svc.start()
    yield svc
    await svc.stop()


# Chunks whose last outputs (39 tokens) cross a block boundary, so the session's
# tail (outputs that never became prompt) fills blocks of its own: 100 + 7 + 100 +
# 39 = 246 tokens, of which the prompt-only clamp would store 192 and the tail store 224.
CHUNKS = ((100, 8), (100, 40), (60, 8))


async def park_reset_resume(service: SessionService, engine: Any, seed: int) -> tuple[list[ChunkResult], int]:
    """Two chunks, park, reset the device cache, third chunk. Returns every chunk's
    result and the transcript length before the resume."""
    rng = random.Random(seed)
    session = await open_session(service)
    results = [await send(service, session, random_tokens(rng, n), m) for n, m in CHUNKS[:2]]
    await service.park(OWNER, session.id)
    assert session.status == "parked" and session.id not in live_request_ids(engine)
    assert service.describe(session).status == "parked"
    transcript = len(session.token_ids)
    # The device prefix cache only; the CPU tier keeps what the session stored.
    await reset_device_prefix_cache(engine)
    n, m = CHUNKS[2]
    results.append(await send(service, session, random_tokens(rng, n), m))
    await service.close(OWNER, session.id)
    return results, transcript


async def test_parked_session_resumes_from_the_cpu_tier(service: SessionService, engine: Any) -> None:
    resumes_before = counter(session_metrics().session_resumes, "cpu_tier")
    results, transcript = await park_reset_resume(service, engine, seed=3)
    resumed = results[-1]
    details = resumed.usage.prompt_tokens_details
    # Everything but the partial last block came from the tier, the tail included.
    assert details.cpu_tier_tokens >= transcript - BLOCK, details
    assert (
        details.device_tokens == 0 and details.computed_tokens == resumed.usage.prompt_tokens - details.cpu_tier_tokens
    )
    assert resumed.resumed_from == "cpu_tier"
    assert counter(session_metrics().session_resumes, "cpu_tier") == resumes_before + 1

    # fp32 oracles: the same chunks on a session never parked, and a recompute.
    rng = random.Random(3)
    never_parked = await open_session(service)
    for (n, m), got in zip(CHUNKS, results):
        reference = await send(service, never_parked, random_tokens(rng, n), m)
        assert got.token_ids == reference.token_ids
    await service.close(OWNER, never_parked.id)
    assert await chunks_unlike_a_recompute(engine, results, seed=3) == []


async def chunks_unlike_a_recompute(engine: Any, results: list[ChunkResult], seed: int) -> list[int]:
    """The chunks of ``park_reset_resume(seed)`` whose answer differs from a salted
    recompute of the session's context before it (float32: token-exact)."""
    rng = random.Random(seed)
    context: list[int] = []
    unlike = []
    for index, ((n, m), got) in enumerate(zip(CHUNKS, results)):
        chunk = random_tokens(rng, n)
        recomputed = await generate_once(engine, context + chunk, m, recompute=True)
        if got.token_ids != list(recomputed.outputs[0].token_ids):
            unlike.append(index)
        context += chunk + got.token_ids
    return unlike


async def test_negative_control_unfixed_connector_resumes_a_parked_session_wrong(unfixed_engine: Any) -> None:
    """With vLLM's unfixed connector, a resumed chunk's blocks reach the tier with
    another chunk's pages: the parked session's resume reads them, and the recompute
    oracle above sees its answer differ."""
    service = make_service(unfixed_engine, disable_streaming_session_fix=True)
    await service.start()
    try:
        results, _ = await park_reset_resume(service, unfixed_engine, seed=3)
    finally:
        await service.stop()
    assert results[-1].resumed_from == "cpu_tier"
    assert 2 in await chunks_unlike_a_recompute(unfixed_engine, results, seed=3)


async def test_negative_control_without_the_tail_store_the_resume_misses_the_tier() -> None:
    settings = make_settings(disable_session_tail_store=True)
    async with started_engine(settings) as engine:
        service = make_service(engine)
        await service.start()
        try:
            results, transcript = await park_reset_resume(service, engine, seed=3)
        finally:
            await service.stop()
    details = results[-1].usage.prompt_tokens_details
    # Only the prompt part reached the tier: the last chunk's 39 outputs are recomputed.
    assert details.cpu_tier_tokens < transcript - BLOCK, details


async def test_a_turn_that_cuts_the_context_resumes_from_the_kept_prefix(service: SessionService, engine: Any) -> None:
    """A chunk may cut the context to a prefix and continue from there (a chat turn whose
    template rewrote an earlier turn). Oracle: float32 greedy, a salted recompute of the
    kept prefix plus the chunk; the kept prefix is served from cache, not recomputed;
    the store replays the cut; and a cut chunk that is undone restores the whole
    context (checked by a later append matching a never-cut recompute)."""
    rng = random.Random(9)
    session = await open_session(service)
    for n, m in ((100, 8), (100, 8)):
        await send(service, session, random_tokens(rng, n), m)
    context, keep, chunk = list(session.token_ids), 150, random_tokens(rng, 20)

    def cut_turn(context_ids: list[int], conversation: Any) -> Turn:
        return Turn(chunk, start=keep)

    run = await service.start_chunk(
        OWNER, session.id, cut_turn, SamplingOptions(max_tokens=8), transport="test", wait=True
    )
    result = await run.result()
    assert result.start == keep and result.usage.prompt_tokens == keep + len(chunk)
    assert session.token_ids == context[:keep] + chunk + result.token_ids
    recomputed = await generate_once(engine, context[:keep] + chunk, 8, recompute=True)
    assert result.token_ids == list(recomputed.outputs[0].token_ids)
    assert result.usage.prompt_tokens_details.cached_tokens >= keep // BLOCK * BLOCK, result.usage
    if service.store.durable:
        loaded = await service.store.load(session.id)
        assert loaded is not None and loaded[1] == session.token_ids

    # Undone: the client leaves mid-answer; the context is whole again.
    context = list(session.token_ids)
    run = await service.start_chunk(
        OWNER, session.id, cut_turn, SamplingOptions(max_tokens=400), transport="test", wait=True
    )
    async for _ in run.events():
        break  # leaving the events early cancels the chunk
    await run.released
    assert session.token_ids == context
    await service.close(OWNER, session.id)


async def test_parking_keeps_closed_and_failed_rules(service: SessionService) -> None:
    session = await open_session(service)
    assert not await service.parking.park([session], "test")  # no engine request yet: nothing to park
    await send(service, session, [5, 6, 7], 2)
    await service.close(OWNER, session.id)
    with pytest.raises(APIError) as closed:
        await service.park(OWNER, session.id)
    assert closed.value.code == "session_not_found"


# -- capacity ------------------------------------------------------------------------

# A device of about 64 blocks (8 MiB, 4 KiB a token in fp32) and 6 engine slots:
# each session below holds 3 to 5 blocks, so a dozen fill the device.
SMALL_DEVICE = {
    "kv_cache_gib": 8 / 1024,
    "max_model_len": 1984,
    "max_num_seqs": 6,
    "max_sessions": 2000,
    "max_chunk_output_tokens": 1900,
}


@pytest_asyncio.fixture(scope="module")
async def small_engine() -> AsyncIterator[Any]:
    async with started_engine(make_settings(**SMALL_DEVICE, served_model_name="small-device")) as engine:
        yield engine


async def test_many_sessions_on_a_small_device_all_answer(small_engine: Any) -> None:
    """Far more sessions than device slots or blocks: each answers a chunk in turn,
    twice, with no error; the ones that do not fit are parked and resumed."""
    service = make_service(small_engine, **SMALL_DEVICE)
    await service.start()
    metrics = session_metrics()
    parks_before = counter(metrics.session_parks, "admission")
    resumes_before = sum(counter(metrics.session_resumes, s) for s in ("cpu_tier", "device", "recompute"))
    rng = random.Random(5)
    try:
        sessions = [await open_session(service) for _ in range(60)]
        for _ in range(2):
            for session in sessions:
                result = await send(service, session, random_tokens(rng, 48), 4)
                assert len(result.token_ids) == 4
        assert all(s.num_chunks == 2 for s in sessions)
        assert counter(metrics.session_parks, "admission") - parks_before >= 40
        resumes = sum(counter(metrics.session_resumes, s) for s in ("cpu_tier", "device", "recompute"))
        assert resumes - resumes_before >= 40
        assert sum(s.has_engine_request for s in sessions) <= SMALL_DEVICE["max_num_seqs"]
    finally:
        await service.stop()
    assert live_request_ids(small_engine) == set()


async def test_a_full_device_never_hangs_a_completion(small_engine: Any) -> None:
    """Idle sessions hold every slot; a plain request (not a session chunk) still
    gets its answer: the service parks idle sessions to make room for it."""
    service = make_service(small_engine, **SMALL_DEVICE)
    await service.start()
    rng = random.Random(6)
    try:
        sessions = [await open_session(service) for _ in range(SMALL_DEVICE["max_num_seqs"])]
        for session in sessions:
            await send(service, session, random_tokens(rng, 200), 4)
        assert all(s.has_engine_request for s in sessions)
        answer = await asyncio.wait_for(generate_once(small_engine, random_tokens(rng, 900), 8), 60)
        assert len(answer.outputs[0].token_ids) == 8
        assert sum(s.status == "parked" for s in sessions) >= 1
    finally:
        await service.stop()


async def test_negative_control_without_the_services_loops_the_completion_waits(small_engine: Any) -> None:
    """The scenario above with the service's background loops not running (nothing
    parks idle sessions for a request that is not a session's): the completion waits in
    vLLM's queue behind the idle sessions and gets no token in 15 s (it would wait for
    ever; 15 s is 8 tokens' decode many times over). So the answer above is the loops'."""
    service = make_service(small_engine, **SMALL_DEVICE)
    await service.store.start()  # the store only: service.start() would start the loops
    rng = random.Random(6)
    sessions = [await open_session(service) for _ in range(SMALL_DEVICE["max_num_seqs"])]
    for session in sessions:
        await send(service, session, random_tokens(rng, 200), 4)
    assert all(s.has_engine_request for s in sessions)
    waiting = asyncio.create_task(generate_once(small_engine, random_tokens(rng, 900), 8))
    try:
        done, _ = await asyncio.wait({waiting}, timeout=15)
        assert not done, "the completion was answered with every slot held: the scenario is not a full device"
    finally:
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await service.stop()


async def test_a_chunk_with_no_room_fails_fast_and_leaves_its_session(small_engine: Any) -> None:
    """One chunk in flight reserves most of the device; another session's chunk
    cannot get room by parking (nothing is idle) and fails after the admission
    timeout with 503 server_busy and Retry-After. Its session is unchanged."""
    service = make_service(small_engine, **SMALL_DEVICE, admission_timeout_s=1.0)
    await service.start()
    rng = random.Random(7)
    try:
        big, small = await open_session(service), await open_session(service)
        await send(service, small, random_tokens(rng, 40), 2)
        await service.park(OWNER, small.id)
        before = (small.status, list(small.token_ids), small.num_chunks)
        # 64 + 1,850 tokens reserve 60 of the device's blocks while the chunk decodes;
        # the small session's resume needs 6 (41 + 40 + 80 tokens).
        assert service.capacity.blocks < 60 + 6
        long_chunk = asyncio.create_task(send(service, big, random_tokens(rng, 64), 1850))
        assert await until(lambda: big.status == "generating")
        with pytest.raises(APIError) as refused:
            await send(service, small, random_tokens(rng, 40), 80)
        assert refused.value.status == 503 and refused.value.code == "server_busy"
        # The refusal is the scenario only while the long chunk still holds the device.
        assert not long_chunk.done(), "the long chunk ended within the admission timeout"
        assert refused.value.headers and int(refused.value.headers["Retry-After"]) >= 1
        assert (small.status, list(small.token_ids), small.num_chunks) == before
        await long_chunk
        retried = await send(service, small, random_tokens(rng, 40), 80)
        assert retried.index == 1
    finally:
        await service.stop()


async def test_backstop_parks_when_vllm_stalls_whatever_the_estimate(small_engine: Any) -> None:
    """The estimate blinded (it sees room for a million requests): idle sessions hold
    every engine slot, and a new session's chunk waits in vLLM's queue with nothing
    running. vLLM's own scheduler stats show the stall; the service parks the least
    recently used idle session, and the chunk answers."""
    service = make_service(small_engine, **SMALL_DEVICE)
    service.parking.capacity = DeviceCapacity(slots=10**6, blocks=10**6, block_size=BLOCK)
    await service.start()
    metrics = session_metrics()
    stalled_before = counter(metrics.session_parks, "stalled")
    rng = random.Random(8)
    try:
        sessions = [await open_session(service) for _ in range(SMALL_DEVICE["max_num_seqs"])]
        for session in sessions:
            await send(service, session, random_tokens(rng, 40), 2)
        late = await open_session(service)
        result = await asyncio.wait_for(send(service, late, random_tokens(rng, 40), 2), 60)
        assert len(result.token_ids) == 2
        # A park counts once the CPU tier holds the session (after its barrier step).
        assert await until(lambda: counter(metrics.session_parks, "stalled") > stalled_before)
        assert sessions[0].status == "parked"  # the least recently used
    finally:
        await service.stop()
