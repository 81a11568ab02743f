"""Admission's device estimate walks only the sessions that hold the device (the
registry's ``device_holders``), not every open session: a server with thousands of
parked sessions pays for the few on the device per chunk. Oracle: the estimate as it
was computed before, over every held session, after each step of a session's life
(chunks, an undone chunk, a park, a request the engine ended, an engine failure, a
close); the two must agree at every step. Fake engine: nothing here is about the
engine, only about which sessions the service counts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.errors import APIError
from app.protocol import SamplingOptions
from app.sessions.admission import DeviceCapacity, DeviceLoad
from app.sessions.service import SessionService
from tests.fast.test_service import GREEDY, OWNER, chunk, running_service
from tests.helpers import until

pytestmark = pytest.mark.timeout(30)


def full_walk(capacity: DeviceCapacity, service: SessionService) -> DeviceLoad:
    """The estimate over every held session (the walk the holders' set replaces)."""
    held = service.registry.held.values()
    return capacity.load(service.parking._engine, [s for s in held if s.device_tokens], service.registry.held)


def assert_estimate_whole(service: SessionService) -> None:
    registry, capacity = service.registry, service.parking.capacity
    assert registry.device_holders == {s for s in registry.held.values() if s.device_tokens}
    assert service.parking._load() == full_walk(capacity, service)


async def test_the_estimate_counts_exactly_the_sessions_on_the_device(tmp_path: Path) -> None:
    async with running_service(tmp_path) as (service, engine):
        sessions = [await service.create(OWNER, GREEDY) for _ in range(4)]
        assert_estimate_whole(service)
        assert service.parking._load() == DeviceLoad(0, 0)
        for session in sessions:
            await chunk(service, session.id, [1, 2, 3])
            assert_estimate_whole(service)
        assert len(service.registry.device_holders) == 4

        # A chunk in flight holds its reservation; a consumer that leaves undoes it (parked).
        engine.hold()
        run = await service.start_chunk(
            OWNER, sessions[0].id, [4, 5], SamplingOptions(max_tokens=20), transport="test", wait=False
        )
        assert_estimate_whole(service)
        events = run.events()
        engine.allow(1)
        await anext(events)
        await events.aclose()
        await run.released
        engine.flow()
        assert sessions[0] not in service.registry.device_holders
        assert_estimate_whole(service)

        # Parked by hand: off the device.
        await service.park(OWNER, sessions[1].id)
        assert sessions[1] not in service.registry.device_holders
        assert_estimate_whole(service)

        # The engine ends a request by itself after its chunk.
        engine.end_after_chunk.add(sessions[2].request_id)
        await chunk(service, sessions[2].id, [6])
        await until(lambda: not sessions[2].has_engine_request)
        assert sessions[2] not in service.registry.device_holders
        assert_estimate_whole(service)

        # An engine failure closes the session; a close forgets it.
        engine.fail_next = RuntimeError("engine failure")
        with pytest.raises(APIError):
            await chunk(service, sessions[3].id, [7])
        await until(lambda: sessions[3].id not in service.registry.held)
        assert_estimate_whole(service)

        # Resumed sessions come back onto the device; a closed one leaves it.
        await chunk(service, sessions[1].id, [8])
        assert sessions[1] in service.registry.device_holders
        await service.close(OWNER, sessions[1].id)
        assert sessions[1] not in service.registry.device_holders
        assert_estimate_whole(service)
        assert service.parking._load() == DeviceLoad(0, 0)


async def test_admission_parks_the_least_recent_holder_when_the_device_is_full(tmp_path: Path) -> None:
    """The holders' set is what admission parks by: with room for two sessions, a third's
    chunk parks the least recently used one, and the estimate stays whole."""
    async with running_service(tmp_path) as (service, _engine):
        service.parking.capacity = DeviceCapacity(slots=2, blocks=1000, block_size=32)
        first, second, third = [await service.create(OWNER, GREEDY) for _ in range(3)]
        await chunk(service, first.id, [1])
        await asyncio.sleep(0.01)  # distinct last activity times
        await chunk(service, second.id, [2])
        await chunk(service, third.id, [3])
        assert (first.status, second.status, third.status) == ("parked", "active", "active")
        assert service.registry.device_holders == {second, third}
        assert_estimate_whole(service)
