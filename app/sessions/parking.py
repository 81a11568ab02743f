"""Admission and parking: room on the device for every chunk, made by parking idle sessions.

Sessions are bounded by the CPU tier, not by device memory: an idle session is
*parked* (its engine request ended, its KV stored in the CPU tier, its transcript
kept) when it has been idle for ``session_park_after_s``, and at once, least recently
used first, when a chunk or any other request would not fit on the device beside the
sessions that hold it (``DeviceCapacity``). A chunk that still does not fit waits at
most ``admission_timeout_s`` for room, then gets 503 ``server_busy``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from vllm import SamplingParams
from vllm.inputs.engine import tokens_input

from app.metrics import SchedulerObserver, SessionMetrics
from app.provenance import ProvenanceRecorder
from app.sessions import errors
from app.sessions.admission import DeviceCapacity, DeviceLoad
from app.sessions.registry import SessionRegistry
from app.sessions.session import StreamingSession

logger = logging.getLogger(__name__)

# How often the device is checked against its capacity (requests other than session
# chunks do not pass through admission).
CAPACITY_CHECK_S = 0.2


class Parking:
    def __init__(
        self,
        engine: Any,
        registry: SessionRegistry,
        metrics: SessionMetrics,
        admission_timeout_s: float,
        observer: SchedulerObserver | None,
        recorder: ProvenanceRecorder | None,
    ) -> None:
        self._engine = engine
        self._registry = registry
        self._metrics = metrics
        self._admission_timeout_s = admission_timeout_s
        self._observer = observer
        self._recorder = recorder
        self.capacity = DeviceCapacity.of(engine)
        # Admission decisions (check, park, reserve) run one at a time.
        self._admission = asyncio.Lock()
        # Set whenever device capacity is freed: a chunk waiting for room re-checks.
        self.capacity_freed = asyncio.Event()
        self._barrier_ids = itertools.count()

    def _load(self, exclude: StreamingSession | None = None) -> DeviceLoad:
        # A session's engine request id is its id: the held sessions' ids are theirs.
        return self.capacity.load(self._engine, self._registry.device_holders, self._registry.held, exclude)

    def _least_recently_used_idle(self, exclude: StreamingSession | None = None) -> StreamingSession | None:
        idle = [s for s in self._registry.held.values() if s.idle and s is not exclude]
        return min(idle, key=lambda s: s.last_activity, default=None)

    async def _park_until(self, fits: Callable[[], bool], reason: str, exclude: StreamingSession | None = None) -> bool:
        """Park idle sessions, least recently used first, until ``fits()``; False
        when none is left to park and it still does not fit."""
        while not fits():
            victim = self._least_recently_used_idle(exclude)
            if victim is None or not await self.park([victim], reason):
                return False
        return True

    async def park(self, sessions: list[StreamingSession], reason: str) -> bool:
        """Park the idle ones of ``sessions``; True when any parked. The engine
        stores their last blocks in its next step, by itself; nothing here waits
        for that (the parks that make room must not wait for room)."""
        taken = [s for s in sessions if s.idle and not s.lock.locked()]
        for session in taken:
            await session.lock.acquire()
            session.parking = True
        try:
            parked = [s for s, ok in zip(taken, await asyncio.gather(*(s.park() for s in taken))) if ok]
        finally:
            for session in taken:
                session.parking = False
                session.lock.release()
        for session in parked:
            logger.info("session %s parked (%s) with %d tokens", session.id, reason, len(session.token_ids))
            self._metrics.session_parks.labels(reason).inc()
        if parked:
            self.capacity_freed.set()
        return bool(parked)

    async def park_idle(self, older_than: float, reason: str) -> None:
        idle = [s for s in self._registry.held.values() if s.idle and s.last_activity < older_than]
        if idle:
            await self.park(idle, reason)

    async def tier_barrier(self) -> None:
        """Return after one more engine step, so that every session parked before
        the call is whole in the CPU tier. vLLM builds an ended request's last
        store jobs in the step after its end, and our host tier copies inside that
        step: a 1-token request that has been answered comes after them. Call it
        before dropping the device cache (the admin reset does)."""
        request_id = f"streamsess-park-barrier-{next(self._barrier_ids)}"
        params = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=True)
        async for _ in self._engine.generate(prompt=tokens_input([0]), sampling_params=params, request_id=request_id):
            pass
        if self._recorder is not None:
            self._recorder.pop(request_id)

    async def admit(self, session: StreamingSession, tokens: int) -> None:
        """Make room on the device for a chunk whose request may reach ``tokens``,
        parking idle sessions as needed, and reserve it. Waits at most
        ``admission_timeout_s`` for room."""
        deadline = time.monotonic() + self._admission_timeout_s
        while True:
            async with self._admission:
                self.capacity_freed.clear()
                if await self._park_until(
                    lambda: self.capacity.fits(self._load(exclude=session), tokens),
                    "admission",
                    exclude=session,
                ):
                    session.device_tokens = tokens  # reserved until the chunk ends
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.server_busy(self._admission_timeout_s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.capacity_freed.wait(), remaining)

    async def keep_device_within_capacity(self) -> None:
        """Park idle sessions while the device is over capacity: requests that are
        not session chunks (vLLM's OpenAI endpoints) would otherwise wait forever
        behind idle sessions. Backstop for the estimate: when vLLM's scheduler
        reports requests waiting and none running at two checks in a row, whatever
        the estimate says, the least recently used idle session is parked."""
        stalled_checks = 0
        while True:
            await asyncio.sleep(CAPACITY_CHECK_S)
            observer = self._observer
            stalled_checks = stalled_checks + 1 if observer is not None and observer.stalled else 0
            async with self._admission:
                await self._park_until(lambda: not self.capacity.over(self._load()), "capacity")
                if stalled_checks >= 2 and (victim := self._least_recently_used_idle()) is not None:
                    await self.park([victim], "stalled")
                    stalled_checks = 0
