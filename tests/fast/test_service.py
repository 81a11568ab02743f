"""The session service's own logic on a fake engine (tests/fake_engine.py), in milliseconds:
the chunk's lock, lease and reservation, undo on a consumer leaving, store failures,
and a server stop. Oracle: the service's own state (locks, transcripts, the store's
rows); nothing here is about the engine's numerics, which the engine tier checks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.errors import APIError
from app.metrics import session_metrics
from app.protocol import SamplingOptions, SessionCreateRequest, SessionDefaults
from app.sessions.service import SessionService
from app.settings import Settings
from app.store import StoreUnavailableError, open_store
from tests.fake_engine import FakeEngine
from tests.helpers import until

# Each test takes milliseconds: a hang is a failure, not a wait.
pytestmark = pytest.mark.timeout(30)

OWNER = "owner"
GREEDY = SessionCreateRequest(defaults=SessionDefaults(temperature=0.0, ignore_eos=True))


@contextlib.asynccontextmanager
async def running_service(tmp_path: Path, **settings: Any) -> AsyncIterator[tuple[SessionService, FakeEngine]]:
    engine = FakeEngine()
    config = Settings(_env_file=None, state_dir=str(tmp_path / "state"), **settings)
    service = SessionService(
        engine, config, "fake", engine.get_tokenizer(), session_metrics(), store=open_store(config)
    )
    await service.start()
    try:
        yield service, engine
    finally:
        engine.flow()
        await service.stop()


async def chunk(
    service: SessionService, session_id: str, ids: list[int], max_tokens: int = 3, wait: bool = False
) -> Any:
    run = await service.start_chunk(
        OWNER, session_id, ids, SamplingOptions(max_tokens=max_tokens), transport="test", wait=wait
    )
    return await run.result()


async def test_a_chunk_cancelled_before_its_first_step_releases_everything(tmp_path: Path) -> None:
    async with running_service(tmp_path) as (service, _engine):
        session = await service.create(OWNER, GREEDY)
        run = await service.start_chunk(
            OWNER, session.id, [1, 2], SamplingOptions(max_tokens=3), transport="test", wait=False
        )
        assert session.lock.locked()
        run.cancel()  # before the run's task has taken a single step
        await run.released
        assert not session.lock.locked() and session.device_tokens == 0
        assert (session.num_chunks, session.token_ids) == (0, [])
        assert (await chunk(service, session.id, [1, 2])).index == 0


async def test_a_consumer_that_leaves_mid_chunk_undoes_it(tmp_path: Path) -> None:
    async with running_service(tmp_path) as (service, engine):
        session = await service.create(OWNER, GREEDY)
        first = await chunk(service, session.id, [5, 6, 7])
        before = list(session.token_ids)
        engine.hold()
        run = await service.start_chunk(
            OWNER, session.id, [8, 9], SamplingOptions(max_tokens=50), transport="test", wait=False
        )
        events = run.events()
        engine.allow(1)
        assert (await anext(events)).token_ids  # the first delta arrived; the rest is held
        await events.aclose()  # the consumer leaves: the chunk is cancelled
        await run.released
        engine.flow()
        assert not session.lock.locked()
        assert session.token_ids == before and session.num_chunks == 1 and session.status == "parked"
        again = await chunk(service, session.id, [8, 9])
        assert again.index == 1 and first.index == 0


async def test_a_chunk_cancelled_while_an_undone_request_unwinds_leaves_the_next_one_whole(tmp_path: Path) -> None:
    """A chunk undone (its consumer left) aborts its engine request, which takes a moment
    to end; the next chunk waits for it, since it reuses the request id. If that next
    chunk is itself cancelled while it waits, the chunk after it must still wait, and the
    aborted request's end must not reach it. Before the fix, it did: "the engine ended the
    session mid-chunk", the session closed (seen once in a clean-clone CI run, after a
    websocket hang-up)."""
    async with running_service(tmp_path) as (service, engine):
        session = await service.create(OWNER, GREEDY)
        engine.abort_delay_s = 0.3
        engine.hold()
        first = await service.start_chunk(
            OWNER, session.id, [1, 2], SamplingOptions(max_tokens=50), transport="test", wait=False
        )
        events = first.events()
        engine.allow(1)
        await anext(events)
        await events.aclose()  # undone: its request is aborted and still ending
        await first.released
        second = await service.start_chunk(
            OWNER, session.id, [3], SamplingOptions(max_tokens=3), transport="test", wait=False
        )
        # Time for the second chunk to reach its wait for the aborted request (0.3 s to
        # end): were it cancelled before that, the test would pass without its scenario.
        await asyncio.sleep(0.05)
        assert session.id in engine.requests, "the aborted request ended before the second chunk was cancelled"
        second.cancel()
        await second.released
        third = await service.start_chunk(
            OWNER, session.id, [4], SamplingOptions(max_tokens=3), transport="test", wait=False
        )
        # The aborted request ends (0.3 s) while the third chunk waits for it; the third
        # then starts a request of its own, held at its first token.
        assert await until(lambda: engine.requests.get(session.id) == [4]), "the third chunk never started"
        engine.flow()
        assert (await third.result()).index == 0
        assert not session.closed and session.token_ids[:1] == [4]


async def test_a_request_the_engine_ended_while_idle_or_before_a_chunk_began_is_started_again(tmp_path: Path) -> None:
    """An idle session's engine request may end on its own, or end as the next chunk is
    appended to it: that chunk goes on a new request from the transcript instead of
    failing and closing the session ("the engine ended the session mid-chunk", seen in a
    clean-clone CI run after websocket hang-ups; its cause is not found yet)."""
    async with running_service(tmp_path) as (service, engine):
        session = await service.create(OWNER, GREEDY)
        engine.end_after_chunk.add(session.id)
        await chunk(service, session.id, [1, 2])
        assert not session.has_engine_request  # ended while idle
        assert (await chunk(service, session.id, [3])).index == 1
        engine.end_on_next_chunk.add(session.id)  # ends when the next chunk is appended
        again = await chunk(service, session.id, [4])
        assert again.index == 2 and len(again.token_ids) == 3
        assert not session.closed and session.num_chunks == 3
        assert engine.requests[session.id][: len(session.token_ids) - 1] == session.token_ids[:-1]


async def test_a_session_closed_before_its_chunk_began_is_not_started_again(tmp_path: Path) -> None:
    """The other way a request ends before a chunk's first token: the session was closed
    (DELETE). That chunk ends with session_closed; no new request is started for it."""
    async with running_service(tmp_path) as (service, engine):
        session = await service.create(OWNER, GREEDY)
        engine.hold()
        run = await service.start_chunk(
            OWNER, session.id, [1, 2], SamplingOptions(max_tokens=3), transport="test", wait=False
        )
        assert await until(lambda: engine.requests.get(session.id) == [1, 2]), "the chunk was never appended"
        await service.close(OWNER, session.id)  # appended, no token yet
        with pytest.raises(APIError) as ended:
            await run.result()
        assert ended.value.code == "session_closed" and session.closed
        # A request started again would wait for chunks for good: it would never go.
        assert await until(lambda: session.id not in engine.requests and not session.has_engine_request, 2.0)


async def test_a_second_chunk_in_flight_is_409_and_the_first_goes_on(tmp_path: Path) -> None:
    async with running_service(tmp_path) as (service, engine):
        session = await service.create(OWNER, GREEDY)
        engine.hold()
        run = await service.start_chunk(
            OWNER, session.id, [1], SamplingOptions(max_tokens=2), transport="test", wait=False
        )
        with pytest.raises(APIError) as refused:
            await chunk(service, session.id, [2])
        assert (refused.value.status, refused.value.code) == (409, "chunk_in_flight")
        engine.flow()
        assert (await run.result()).index == 0
        # The result is told once the session is free: the next chunk is taken at once.
        assert (await chunk(service, session.id, [2])).index == 1


async def test_defaults_updated_while_a_chunk_waits_for_the_lock_apply_to_it(tmp_path: Path) -> None:
    """A chunk queued behind another (a websocket's) takes the session's defaults as they
    are when it starts, not when it was sent: its sampling parameters are built again
    after the wait if an update replaced the defaults meanwhile."""
    async with running_service(tmp_path) as (service, engine):
        session = await service.create(OWNER, GREEDY)
        engine.hold()
        first = await service.start_chunk(
            OWNER, session.id, [1, 2], SamplingOptions(max_tokens=5), transport="test", wait=False
        )
        queued = asyncio.create_task(
            service.start_chunk(OWNER, session.id, [3], SamplingOptions(), transport="test", wait=True)
        )
        # Its parameters were built from the old defaults before it queued for the lock;
        # an update that came before that would pass the test without its scenario.
        assert await until(lambda: bool(session.lock._waiters)), "the second chunk never queued for the lock"
        await service.update_defaults(OWNER, session.id, SessionDefaults(max_tokens=2))
        engine.flow()
        await first.result()
        assert len((await (await queued).result()).token_ids) == 2


async def test_a_commit_the_store_refuses_undoes_the_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_service(tmp_path) as (service, _engine):
        session = await service.create(OWNER, GREEDY)
        await chunk(service, session.id, [1, 2])
        before = list(session.token_ids)

        async def store_down(*args: Any, **kwargs: Any) -> bool:
            raise StoreUnavailableError("disk full")

        monkeypatch.setattr(service.store, "commit_chunk", store_down)
        with pytest.raises(APIError) as failed:
            await chunk(service, session.id, [3])
        assert (failed.value.status, failed.value.code) == (503, "store_unavailable")
        assert session.token_ids == before and not session.lock.locked()
        monkeypatch.undo()
        assert (await chunk(service, session.id, [3])).index == 1


async def test_an_engine_failure_closes_the_session_and_frees_it(tmp_path: Path) -> None:
    async with running_service(tmp_path) as (service, engine):
        session = await service.create(OWNER, GREEDY)
        engine.fail_next = RuntimeError("engine exploded")
        with pytest.raises(APIError) as failed:
            await chunk(service, session.id, [1])
        assert (failed.value.status, failed.value.code) == (500, "session_failed")
        assert session.closed and not session.lock.locked()
        record = await service.store.get(session.id)
        assert record is not None and record.status == "closed"


async def test_a_chunk_the_engine_refuses_is_undone_and_the_session_goes_on(tmp_path: Path) -> None:
    """vLLM's input processing raises ValueError/TypeError/OverflowError for a chunk it
    cannot take (schemathesis found a seed beyond 64 bits closing the session with a
    500): that chunk is a 400, undone, and the session answers its next chunk as if
    the refused one had never been sent. Negative control: the engine failure above."""
    async with running_service(tmp_path) as (service, engine):
        session = await service.create(OWNER, GREEDY)
        twin = await service.create(OWNER, GREEDY)
        for target in (session, twin):
            await chunk(service, target.id, [5, 6, 7])
        before = (list(session.token_ids), session.num_chunks)
        engine.fail_next = OverflowError("can't serialize ints < -2**63")
        with pytest.raises(APIError) as refused:
            await chunk(service, session.id, [8, 9])
        assert (refused.value.status, refused.value.code) == (400, "invalid_request")
        assert not session.closed and not session.lock.locked()
        assert (session.token_ids, session.num_chunks) == before
        record = await service.store.get(session.id)
        assert record is not None and record.status != "closed" and record.num_chunks == 1
        after = await chunk(service, session.id, [8, 9])
        assert after.token_ids == (await chunk(service, twin.id, [8, 9])).token_ids
        assert after.index == 1


async def test_a_server_stop_parks_and_closes_nothing_in_the_store(tmp_path: Path) -> None:
    """Chunks in flight are undone, every session parked; the store keeps them open."""
    async with running_service(tmp_path) as (service, engine):
        idle = await service.create(OWNER, GREEDY)
        await chunk(service, idle.id, [1, 2])
        busy = await service.create(OWNER, GREEDY)
        engine.hold()
        run = await service.start_chunk(
            OWNER, busy.id, [3], SamplingOptions(max_tokens=5), transport="test", wait=False
        )
        consumer = asyncio.create_task(run.result())
        engine.allow(1)
        await asyncio.sleep(0.01)  # let the first token out; the rest are held
        await service.stop()
        with pytest.raises(APIError) as undone:
            await consumer
        assert (undone.value.status, undone.value.code) == (503, "chunk_undone")
        assert not busy.lock.locked() and not engine.requests
        restarted = open_store(service._settings)
        await restarted.start()
        try:
            for session, chunks in ((idle, 1), (busy, 0)):
                record = await restarted.get(session.id)
                assert record is not None and record.status != "closed" and record.num_chunks == chunks, record
                # No lease is left behind: another replica takes the session at once.
                leased = await restarted.acquire_lease(session.id, "another-replica", 30)
                assert getattr(leased, "num_chunks", None) == chunks, leased
        finally:
            await restarted.close()
        await service.store.start()  # running_service stops it once more


async def test_the_context_keeps_every_output_token(tmp_path: Path) -> None:
    """vLLM's streaming input drops a chunk's last sampled token when the next chunk
    arrives (the fake engine does the same); the session sends it again at the head of
    that chunk, so the context is every input and every output token the client got.
    The real-engine oracle is tests/api/sessions/test_sessions_rest.py (each chunk against a
    salted recompute of that whole context)."""
    async with running_service(tmp_path) as (service, engine):
        session = await service.create(OWNER, GREEDY)
        first = await chunk(service, session.id, [5, 6, 7])
        assert session.token_ids == [5, 6, 7, *first.token_ids]
        second = await chunk(service, session.id, [8])
        assert session.token_ids == [5, 6, 7, *first.token_ids, 8, *second.token_ids]
        # The engine's request holds it all but the last token of the last answer.
        assert engine.requests[session.request_id] == session.token_ids[:-1]
        details = second.usage.prompt_tokens_details
        assert (details.device_tokens, details.computed_tokens) == (len(first.token_ids) + 2, 2)


async def test_an_expired_conversation_reopens_with_its_items_and_context(tmp_path: Path) -> None:
    """OpenAI keeps a conversation however long it is idle: ours, closed for being idle
    like any session (``expired``), opens again when it is used, parked, with its items and
    its context as they were, and goes on. A conversation deleted, or a session that is
    not a conversation, stays closed. (Before: the expired conversation was 404.)"""
    from app.api.conversations.serving import ConversationsService
    from app.api.responses.serving import ResponsesService
    from app.sessions.errors import EXPIRED
    from app.tools.parsing import ReplyParsers

    async with running_service(tmp_path) as (service, engine):
        tokenizer = engine.get_tokenizer()
        conversations = ConversationsService(
            ResponsesService(service, service.store, tokenizer, ReplyParsers(tokenizer, None, None))
        )
        conversation_id = (await conversations.create(OWNER, [{"role": "user", "content": "hello"}], None))["id"]
        first = await chunk(service, conversation_id, [1, 2, 3])
        context = list((await service.get(OWNER, conversation_id)).token_ids)
        await service.close(OWNER, conversation_id, reason=EXPIRED)
        assert (await service.get(OWNER, conversation_id, include_closed=True)).closed

        assert (await conversations.retrieve(OWNER, conversation_id))["id"] == conversation_id
        session = await service.get(OWNER, conversation_id)
        assert (session.status, session.token_ids, session.num_chunks) == ("parked", context, 1)
        assert [item["content"][0]["text"] for item in await conversations.list_items(OWNER, conversation_id)] == [
            "hello"
        ]
        second = await chunk(service, conversation_id, [4, 5])
        assert second.index == first.index + 1
        assert session.token_ids == [*context, 4, 5, *second.token_ids]

        await conversations.delete(OWNER, conversation_id)
        with pytest.raises(APIError) as deleted:
            await conversations.retrieve(OWNER, conversation_id)
        assert deleted.value.status == 404
        plain = await service.create(OWNER, GREEDY)
        await service.close(OWNER, plain.id, reason=EXPIRED)
        with pytest.raises(APIError) as closed:
            await service.attach(OWNER, plain.id)
        assert closed.value.code == "session_closed"


async def test_a_session_being_closed_is_not_listed_while_its_store_row_is_written(tmp_path: Path) -> None:
    """An expired session is closed at once; its store row is written after. The list in
    between (any replica's list reads the store) must not show it open. Found as a race
    of the engine tier's expiry test; here the store write is held to make it certain."""
    async with running_service(tmp_path) as (service, _engine):
        session = await service.create(OWNER, GREEDY)
        writing, release = asyncio.Event(), asyncio.Event()
        update = service.store.update

        async def slow_update(*args: Any, **fields: Any) -> None:
            if fields.get("status") == "closed":
                writing.set()
                await release.wait()
            await update(*args, **fields)

        service.store.update = slow_update  # type: ignore[method-assign]
        closing = asyncio.create_task(service._close(session, "expired"))
        await asyncio.wait_for(writing.wait(), 10)
        assert session.closed
        assert session.id not in {s.id for s in await service.list_sessions(OWNER)}
        release.set()
        await closing
        assert session.id not in {s.id for s in await service.list_sessions(OWNER)}


async def test_a_chunk_waiting_for_device_room_keeps_its_lease(tmp_path: Path) -> None:
    """Waiting for room on the device (up to admission_timeout_s) can outlast a lease
    (session_lease_s): the lease is renewed from the moment it is taken, so no other
    replica can take the session meanwhile. Negative control: renewed only once the
    chunk is admitted (as before), the held admission never sees a renewal."""
    from app.store import LeaseRefused

    async with running_service(tmp_path, session_lease_s=0.3) as (service, _engine):
        session = await service.create(OWNER, GREEDY)
        renewed, room = asyncio.Event(), asyncio.Event()
        renew, admit = service.store.renew_lease, service.parking.admit

        async def counted_renew(*args: Any) -> bool:
            result = await renew(*args)
            renewed.set()
            return bool(result)

        async def held_admit(*args: Any) -> None:
            await room.wait()
            await admit(*args)

        service.store.renew_lease = counted_renew  # type: ignore[method-assign]
        service.parking.admit = held_admit  # type: ignore[method-assign]
        starting = asyncio.create_task(
            service.start_chunk(OWNER, session.id, [1, 2], SamplingOptions(max_tokens=2), transport="test", wait=False)
        )
        await asyncio.wait_for(renewed.wait(), 5)  # a TimeoutError here: not renewed while it waited
        renewed.clear()
        await asyncio.wait_for(renewed.wait(), 5)  # and again, past the lease's first term
        assert await service.store.acquire_lease(session.id, "another-replica", 30) is LeaseRefused.HELD
        room.set()
        run = await starting
        assert (await run.result()).index == 0


async def test_the_session_gauges_are_what_the_sessions_are_when_scraped(tmp_path: Path) -> None:
    """The gauges are counted when /metrics is read, not kept up on every change. Oracle:
    the registry's samples after each change, against the sessions' own states."""
    from prometheus_client import REGISTRY

    def gauges() -> tuple[float | None, ...]:
        return tuple(REGISTRY.get_sample_value(f"streamsess_sessions_{name}") for name in ("open", "parked", "active"))

    async with running_service(tmp_path) as (service, _engine):
        first = await service.create(OWNER, GREEDY)
        second = await service.create(OWNER, GREEDY)
        assert gauges() == (2, 0, 0)
        await chunk(service, first.id, [1, 2])
        await chunk(service, second.id, [3, 4])
        assert gauges() == (2, 0, 2)
        await service.park(OWNER, first.id)
        assert gauges() == (2, 1, 1)
        await service.close(OWNER, second.id)
        assert gauges() == (1, 1, 0)
