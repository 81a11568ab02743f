"""The drain's logic on a fake engine (tests/fake_engine.py): what it refuses, what it
waits for, and that it stops waiting. Oracle: the service's own answers and state; the
end-to-end drain (SIGTERM, HAProxy, two replicas) is in tests/deploy."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.errors import APIError
from app.protocol import SamplingOptions
from tests.fast.test_service import GREEDY, OWNER, chunk, running_service

pytestmark = pytest.mark.timeout(30)


async def test_a_drain_refuses_new_work_and_waits_for_the_chunk_in_flight_to_be_delivered(tmp_path: Path) -> None:
    async with running_service(tmp_path) as (service, engine):
        session = await service.create(OWNER, GREEDY)
        other = await service.create(OWNER, GREEDY)
        assert await service.not_ready() == []
        engine.hold()
        run = await service.start_chunk(
            OWNER, session.id, [1, 2], SamplingOptions(max_tokens=3), transport="test", wait=False
        )
        drain = asyncio.create_task(service.drain(10))
        await asyncio.sleep(0.05)
        assert not drain.done()  # the chunk in flight holds it
        assert await service.not_ready() == ["draining"]
        for refused in (service.create(OWNER, GREEDY), chunk(service, other.id, [3])):
            with pytest.raises(APIError) as caught:
                await refused
            assert (caught.value.status, caught.value.code) == (503, "server_draining")
            assert caught.value.headers == {"Retry-After": "1"}
        engine.flow()
        assert (await run.result()).index == 0  # the consumer reads the end: released...
        await asyncio.sleep(0.05)
        assert drain.done() and await drain  # ...and delivered: the drain is over
        assert session.num_chunks == 1  # the chunk in flight was kept
        assert other.num_chunks == 0  # the refused one did nothing


async def test_a_drain_stops_waiting_at_its_timeout(tmp_path: Path) -> None:
    async with running_service(tmp_path) as (service, engine):
        session = await service.create(OWNER, GREEDY)
        engine.hold()
        run = await service.start_chunk(
            OWNER, session.id, [1, 2], SamplingOptions(max_tokens=3), transport="test", wait=False
        )
        assert await service.drain(0.2) is False
        run.cancel()
        await run.released


async def test_a_drain_waits_for_the_consumer_not_only_the_chunk(tmp_path: Path) -> None:
    """Negative control of the delivery wait: a chunk that has ended and released its
    session, whose consumer has not read its end yet, still holds the drain."""
    async with running_service(tmp_path) as (service, _engine):
        session = await service.create(OWNER, GREEDY)
        run = await service.start_chunk(
            OWNER, session.id, [1, 2], SamplingOptions(max_tokens=3), transport="test", wait=False
        )
        await run.released  # ended, released, nobody has read it
        assert await service.drain(0.2) is False
        assert (await run.result()).index == 0
        assert await service.drain(1) is True
