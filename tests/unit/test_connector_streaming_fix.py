"""The seed bug (vLLM PR #60810) on vLLM's real Scheduler, with and without our fix.

A streaming session's first chunk (8 tokens, block size 4) stores blocks (0, 1).
Resumed with a 12-token chunk, its context is 8 + 1 kept output + 12 = 21 tokens,
so blocks 2, 3 and 4 are new and must be stored from the session's own blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as upstream_scheduler
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)

from connectors import compat
from connectors.offloading import StreamingSafeOffloadingScheduler
from connectors.simple import StreamingSafeSimpleCPUOffloadScheduler
from tests.unit.scheduler_harness import EOS_TOKEN_ID, SchedulerHarness

FIRST_CHUNK = list(range(1, 9))
SECOND_CHUNK = list(range(200, 212))


def run_two_chunk_session(harness: SchedulerHarness) -> tuple[list[int], list[int]]:
    """Device-block offsets stored for each of the session's two chunks."""
    harness.add_chunk("session", FIRST_CHUNK)
    first = harness.run([100, EOS_TOKEN_ID])
    harness.add_chunk("session", SECOND_CHUNK)
    second = harness.run([300, EOS_TOKEN_ID])
    return first, second


def connector_scheduler(harness: SchedulerHarness) -> Any:
    if harness.connector_kind == "offloading":
        return harness.connector.connector_scheduler
    return harness.connector.scheduler_manager


@pytest.fixture(autouse=True)
def fresh_detection() -> Iterator[None]:
    compat.upstream_has_streaming_fix.cache_clear()
    yield
    compat.upstream_has_streaming_fix.cache_clear()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("connector", ["offloading", "simple"])
def test_resumed_session_stores_its_new_blocks(connector: str, async_scheduling: bool) -> None:
    harness = SchedulerHarness(connector, async_scheduling)  # type: ignore[arg-type]
    assert isinstance(
        connector_scheduler(harness),
        StreamingSafeOffloadingScheduler | StreamingSafeSimpleCPUOffloadScheduler,
    )
    first, second = run_two_chunk_session(harness)
    assert first == [0, 1]
    assert sorted(second) == [2, 3, 4]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("connector", ["offloading", "simple"])
def test_negative_control_unfixed_connector_shows_the_seed_bug(connector: str, async_scheduling: bool) -> None:
    """The same session on vLLM's own scheduler side (fix disabled) goes wrong,
    so the test above can fail."""
    harness = SchedulerHarness(connector, async_scheduling, disable_fix=True)  # type: ignore[arg-type]
    # vLLM's own class, or ours for the session tail store alone.
    assert not getattr(connector_scheduler(harness), "streaming_fix", False)
    first, second = run_two_chunk_session(harness)
    assert first == [0, 1]
    assert sorted(second) != [2, 3, 4]
    if connector == "offloading":
        # The doubled table pairs the new chunks' keys with the old blocks:
        # vLLM's PR reports exactly (0, 1, 2) on the unfixed code.
        assert sorted(second) == [0, 1, 2]
    else:
        # The simple connector's cursor points into the stale copy: blocks 3 and 4
        # of the new chunk are never offloaded.
        assert not {3, 4} & set(second)


def _yield_req_data_033(scheduler_output: Any) -> Iterator[tuple[str, Any, bool]]:
    """vLLM 0.33's yield_req_data: new requests carry a full table."""
    for req in scheduler_output.scheduled_new_reqs:
        yield req.req_id, req.block_ids, True
    cached = scheduler_output.scheduled_cached_reqs
    yield from zip(
        cached.req_ids,
        cached.new_block_ids,
        (req_id in cached.resumed_req_ids for req_id in cached.req_ids),
    )


def test_detection_reads_the_installed_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm
    from packaging.version import Version
    from vllm.distributed.kv_transfer.kv_connector import utils

    # The fix shipped in 0.33: the probe must agree with the installed version.
    fixed_release = Version(vllm.__version__).release >= (0, 33)
    assert compat.yield_req_data_reports_full_tables() is fixed_release
    assert compat.streaming_fix_wanted({}) is (not fixed_release)
    assert compat.streaming_fix_wanted({compat.DISABLE_FIX_KEY: "true"}) is False
    # Synchronous loads came with 0.33 too (sync_load_budget_bytes).
    assert compat.upstream_has_sync_loads() is fixed_release

    monkeypatch.setattr(utils, "yield_req_data", _yield_req_data_033)
    compat.upstream_has_streaming_fix.cache_clear()
    assert compat.yield_req_data_reports_full_tables() is True
    assert compat.streaming_fix_wanted({}) is False


@pytest.mark.parametrize("disable_tail_store", [False, True], ids=["tail-store", "no-tail-store"])
def test_fixed_vllm_keeps_upstream_scheduler(monkeypatch: pytest.MonkeyPatch, disable_tail_store: bool) -> None:
    """On a vLLM that has the fix, our streaming fix stands aside; our class stays
    only for the session tail store, which no vLLM release has."""
    from vllm.distributed.kv_transfer.kv_connector import utils

    monkeypatch.setattr(utils, "yield_req_data", _yield_req_data_033)
    monkeypatch.setattr(upstream_scheduler, "yield_req_data", _yield_req_data_033)
    monkeypatch.setattr(compat, "upstream_has_sync_loads", lambda: True)  # 0.33 has both
    harness = SchedulerHarness("offloading", async_scheduling=False, disable_tail_store=disable_tail_store)
    scheduler = connector_scheduler(harness)
    if disable_tail_store:
        assert type(scheduler) is OffloadingConnectorScheduler
    else:
        assert isinstance(scheduler, StreamingSafeOffloadingScheduler) and not scheduler.streaming_fix
    first, second = run_two_chunk_session(harness)
    assert (first, sorted(second)) == ([0, 1], [2, 3, 4])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_fix_is_idempotent_on_a_fixed_vllm(monkeypatch: pytest.MonkeyPatch, async_scheduling: bool) -> None:
    """Forcing our fix onto a vLLM whose scheduler already resets the table (0.33
    semantics of yield_req_data drive 0.32's reset branch) changes nothing."""
    monkeypatch.setattr(upstream_scheduler, "yield_req_data", _yield_req_data_033)
    monkeypatch.setattr(compat, "upstream_has_streaming_fix", lambda: False)
    harness = SchedulerHarness("offloading", async_scheduling)
    assert isinstance(connector_scheduler(harness), StreamingSafeOffloadingScheduler)
    first, second = run_two_chunk_session(harness)
    assert (first, sorted(second)) == ([0, 1], [2, 3, 4])


@pytest.mark.parametrize("disable_fix", [False, True], ids=["fixed", "negative-control"])
def test_restart_from_token_zero_offers_every_chunk_again(disable_fix: bool) -> None:
    """vLLM PR #63010: a preempted request restarts from token 0; when its earlier
    chunks are no longer in the tier (the recording manager misses every lookup),
    they must be stored again, or the tier keeps a hole before the old cursor."""
    harness = SchedulerHarness("offloading", async_scheduling=False, disable_fix=disable_fix)
    harness.add_chunk("request", list(range(1, 17)))
    assert harness.run([5, 6, 7], max_steps=3) == [0, 1, 2, 3]
    # Preempt the running request (device cache reset); the tier is kept.
    assert harness.scheduler.reset_prefix_cache(reset_running_requests=True)
    stored_after_restart = sorted(harness.run([8, EOS_TOKEN_ID]))
    if disable_fix:
        assert stored_after_restart == [4]
    else:
        assert stored_after_restart == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("disable_fix", "async_tier_loads"),
    [(False, False), (False, True), (True, True)],
    ids=["fixed-synchronous-loads", "fixed-vllm-0.32-protocol", "negative-control"],
)
def test_reset_that_preempts_and_reloads_in_one_step(disable_fix: bool, async_tier_loads: bool) -> None:
    """Found by the correctness harness: a cache reset with running requests preempts
    a request, and the same step reschedules it with a load from the tier. vLLM 0.32
    (its own asynchronous load protocol, the negative control) asserted that a
    preempted request's jobs are all stores and killed the engine core; 0.33 skips
    the not-yet-submitted load, and so do we. Our synchronous loads are booked
    complete before that check, so they never meet it."""
    harness = SchedulerHarness(
        "offloading", async_scheduling=False, disable_fix=disable_fix, async_tier_loads=async_tier_loads
    )
    manager = harness.connector.connector_scheduler.manager
    harness.add_chunk("request", list(range(1, 17)))
    assert harness.run([5, 6, 7], max_steps=3) == [0, 1, 2, 3]
    manager.serve_hits = True  # the stored chunks can now be loaded back
    assert harness.scheduler.reset_prefix_cache(reset_running_requests=True)
    if disable_fix:
        with pytest.raises(AssertionError):
            harness.run([8, EOS_TOKEN_ID])
        return
    assert harness.run([8, EOS_TOKEN_ID]) == [4]
    assert len(manager.loaded_keys) == 4  # the restart was served from the tier


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("disable_tail_store", [False, True], ids=["tail-store", "negative-control"])
def test_ended_session_stores_its_last_outputs(async_scheduling: bool, disable_tail_store: bool) -> None:
    """vLLM's default offload_prompt_only: a session's outputs become prompt only when
    its next chunk comes, so when the session ends after a chunk (the server parks
    it), its last outputs never reached the tier. With the tail store they do.

    Chunk: 8 tokens (blocks 0, 1), then outputs 100..103 and EOS: 13 tokens have KV
    (EOS, the last sampled token, has none), so block 2 (outputs 100..103) is full."""
    harness = SchedulerHarness(
        "offloading", async_scheduling, offload_prompt_only=True, disable_tail_store=disable_tail_store
    )
    manager = harness.connector.connector_scheduler.manager
    harness.add_chunk("session", FIRST_CHUNK)
    assert harness.run([100, 101, 102, 103, EOS_TOKEN_ID]) == [0, 1]  # the prompt only, while it runs
    assert len(manager.stored_keys) == 2
    harness.end_session("session")
    after_end = harness.run([])
    if disable_tail_store:
        assert after_end == [] and len(manager.stored_keys) == 2
    else:
        assert len(after_end) == 1 and len(manager.stored_keys) == 3


def prompt_only_in_the_tier(harness: SchedulerHarness) -> tuple[Any, list[int]]:
    """A 16-token prompt (four full blocks) computed, stored to the tier, and dropped
    from the device cache; the recording manager then serves it as hits."""
    manager = harness.connector.connector_scheduler.manager
    prompt = list(range(1, 17))
    harness.add_chunk("first", prompt)
    assert harness.run([5, EOS_TOKEN_ID]) == [0, 1, 2, 3]
    harness.end_session("first")
    harness.run([])
    assert harness.scheduler.reset_prefix_cache()
    manager.serve_hits = True
    return manager, prompt


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("async_tier_loads", [False, True], ids=["synchronous-loads", "vllm-0.32-protocol"])
def test_tier_hit_is_scheduled_in_the_step_that_finds_it(async_scheduling: bool, async_tier_loads: bool) -> None:
    """Issue 15: with a worker that copies inside submit_load, a tier hit needs no
    extra engine step. Our connector reports the load as synchronous, so vLLM's
    scheduler runs the request in the step that found the hit and has the model
    runner submit the load before that step's forward pass. vLLM 0.32's own protocol
    (the negative control) parks it in WAITING_FOR_REMOTE_KVS for a step."""
    from vllm.v1.request import RequestStatus

    harness = SchedulerHarness("offloading", async_scheduling, async_tier_loads=async_tier_loads)
    manager, prompt = prompt_only_in_the_tier(harness)

    harness.add_chunk("second", [*prompt, 95, 96, 97, 98, 99])
    output = harness.scheduler.schedule()
    request = harness.scheduler.requests["second"]
    metadata = output.kv_connector_metadata
    assert len(metadata.load_jobs) == 1
    if async_tier_loads:
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert "second" not in output.num_scheduled_tokens and not output.has_sync_kv_loads
    else:
        assert request.status == RequestStatus.RUNNING and output.has_sync_kv_loads
        # The 16 loaded tokens count as computed: only the 5 new ones are prefilled,
        # and the block they complete is stored in the same step as the load (found
        # by the correctness harness: upstream asserted a load never meets a store).
        assert output.num_scheduled_tokens["second"] == 5
        assert [len(job.src_spec.block_ids) for job in metadata.store_jobs.values()] == [1]
    harness.scheduler.update_from_output(output, harness._model_output(list(harness.scheduler.running), 7))
    harness.run([EOS_TOKEN_ID])  # the rest runs to the end without an assertion in vLLM
    # All four chunks were loaded into the new request's own blocks: vLLM caches a
    # synchronous hit's blocks at allocation, which must not hide them from the load.
    assert len(manager.loaded_keys) == 4
    assert request.num_computed_tokens >= len(prompt)


def test_synchronous_hit_on_a_whole_prompt_computes_its_last_token() -> None:
    """Found by test_seed_e2e: a prompt wholly in the tier left vLLM's scheduler
    nothing to compute (its assert num_new_tokens > 0 killed the engine core). The
    asynchronous protocol drops the last token from the hit when the load lands;
    a synchronous hit must leave it out itself."""
    harness = SchedulerHarness("offloading", async_scheduling=False)
    manager, prompt = prompt_only_in_the_tier(harness)

    harness.add_chunk("second", prompt)
    output = harness.scheduler.schedule()
    assert output.has_sync_kv_loads and output.num_scheduled_tokens["second"] == 1
    assert len(manager.loaded_keys) == 4  # the last chunk still loads whole
    harness.scheduler.update_from_output(output, harness._model_output(list(harness.scheduler.running), 7))
    harness.run([EOS_TOKEN_ID])
