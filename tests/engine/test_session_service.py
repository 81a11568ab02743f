"""SessionService on the real engine, with no HTTP: idle expiry and clean shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.protocol import SamplingOptions, SessionCreateRequest
from app.sessions.service import SessionService
from app.wiring import session_service
from tests.conftest import make_settings
from tests.helpers import live_request_ids, wait_until_gone

pytestmark = pytest.mark.engine


def make_service(engine: Any, **overrides: Any) -> SessionService:
    return session_service(engine, make_settings(**overrides))


async def test_idle_session_expires_and_frees_its_request(engine: Any) -> None:
    service = make_service(engine, session_idle_timeout_s=0.3)
    await service.start()
    try:
        session = await service.create("owner", SessionCreateRequest())
        run = await service.start_chunk(
            "owner", session.id, [1, 2, 3], SamplingOptions(max_tokens=2), transport="test", wait=False
        )
        await run.result()
        assert session.id in live_request_ids(engine)  # waiting for its next chunk
        for _ in range(100):
            if session.closed:
                break
            await asyncio.sleep(0.05)
        assert session.close_reason == "expired"
        assert await wait_until_gone(engine, session.id)
        assert session.id not in {s.id for s in await service.list_sessions("owner")}
    finally:
        await service.stop()


async def test_stop_ends_every_engine_request_and_keeps_durable_sessions(engine: Any) -> None:
    service = make_service(engine)
    await service.start()
    sessions = [await service.create("owner", SessionCreateRequest()) for _ in range(3)]
    for session in sessions:
        run = await service.start_chunk(
            "owner", session.id, "hello", SamplingOptions(max_tokens=1), transport="test", wait=False
        )
        await run.result()
    await service.stop()
    assert all(s.close_reason == "server_shutdown" for s in sessions)
    for session in sessions:
        assert await wait_until_gone(engine, session.id)
    # In this process, that is: the store keeps them open, for the next server.
    restarted = make_service(engine)
    await restarted.start()
    try:
        listed = {s.id: s.status for s in await restarted.list_sessions("owner")}
        assert all(listed[s.id] == "parked" for s in sessions)
    finally:
        await restarted.stop()


class EngineThatFails:
    """The real engine, except that generate() fails: an engine error mid-session."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("engine exploded")
        yield  # an async generator, like AsyncLLM.generate


async def test_engine_failure_fails_the_chunk_and_closes_the_session(engine: Any) -> None:
    from app.errors import APIError

    service = make_service(EngineThatFails(engine))
    await service.start()
    try:
        session = await service.create("owner", SessionCreateRequest())
        run = await service.start_chunk(
            "owner", session.id, [1, 2], SamplingOptions(max_tokens=2), transport="test", wait=False
        )
        with pytest.raises(APIError) as failed:
            await run.result()
        assert failed.value.status == 500 and failed.value.code == "session_failed"
        assert session.close_reason == "engine_error" and not session.lock.locked()
        assert session.id not in {s.id for s in await service.list_sessions("owner")}
    finally:
        await service.stop()
