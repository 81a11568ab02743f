"""ChunkRun: one admitted chunk, running in a task of its own, that owns its resources.

Once every check has passed, a chunk holds its session's lock, its lease in the store
and its device reservation. Those were once handed to each transport to release, and a
transport that awaited anything first (Realtime sends four events before streaming)
leaked them when its client left at that moment: the session stayed locked for good.
Now the chunk runs in its own task from the moment it is admitted, and the task's
done-callback releases everything, however the task ends: completion, an error, a
cancellation before its first step, or a consumer that went away. Consumers only read
``events()`` or ``result()``; leaving either early cancels the chunk (it is undone, the
session stays), and ``stop()`` ends the answer early and keeps what it generated.

Once committed, a chunk is not undone: a cancel then is a no-op, and what the turn
leaves besides the session (``on_commit``: a stored response, conversation items) is
written by the run's own task, whatever its consumer does meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Final

from app.sessions.chunk import ChunkDelta, ChunkResult
from app.sessions.errors import chunk_undone
from app.sessions.session import StreamingSession

logger = logging.getLogger(__name__)

ChunkEvent = ChunkDelta | ChunkResult
# A turn's durable effects beside its session, written once its chunk is committed.
AfterCommit = Callable[[ChunkResult], Awaitable[None]]
_END: Final = object()


class ChunkRun:
    """One chunk in flight: ``produce(run)`` gives its events; ``release(run)`` is called
    exactly once, when the chunk's task has ended, whatever ended it: it frees what the
    chunk held at once and may return the store's part of the cleanup to await."""

    def __init__(
        self,
        session: StreamingSession,
        produce: Callable[[ChunkRun], AsyncIterator[ChunkEvent]],
        release: Callable[[ChunkRun], Awaitable[None] | None],
    ) -> None:
        self.session = session
        self.committed = False  # set by the producer once the store holds the chunk
        self.after_commit: AfterCommit | None = None  # set through on_commit
        # Set to end the answer early, keeping the session (StreamingSession.generate).
        self.stop_requested = asyncio.Event()
        self._release = release
        self._events: asyncio.Queue[object] = asyncio.Queue()
        self._task = asyncio.create_task(self._drive(produce(self)), name=f"chunk-{session.id}")
        # Set once the resources are released; the service waits on it at shutdown.
        self.released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Set once the consumer is done with the events (its last one sent on): a drain
        # waits for it, so that a websocket is not closed between the end and its event.
        self.delivered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task.add_done_callback(self._on_done)

    async def _drive(self, produce: AsyncIterator[ChunkEvent]) -> None:
        async for event in produce:
            self._events.put_nowait(event)

    def _on_done(self, task: asyncio.Task[None]) -> None:
        try:
            cleanup = self._release(self)
        except Exception:
            logger.exception("session %s: releasing a chunk failed", self.session.id)
            cleanup = None
        finally:
            self._events.put_nowait(_END)
            if not task.cancelled() and (error := task.exception()) is not None:
                self._events.put_nowait(error)
        if cleanup is None:
            self._set_released()
        else:
            # The store's part awaits; it runs in a task nobody can cancel by leaving.
            asyncio.get_running_loop().create_task(self._cleanup(cleanup), name=f"chunk-release-{self.session.id}")

    async def _cleanup(self, cleanup: Awaitable[None]) -> None:
        try:
            await cleanup
        except Exception:
            logger.exception("session %s: releasing a chunk in the store failed", self.session.id)
        finally:
            self._set_released()

    def _set_released(self) -> None:
        # A waiter cancelled while gathering it (a server stop cut short) cancels the future.
        if not self.released.done():
            self.released.set_result(None)

    @property
    def done(self) -> bool:
        return self._task.done()

    def stop(self) -> None:
        """End the answer at its next token; the session keeps what was generated."""
        self.stop_requested.set()

    def on_commit(self, effects: AfterCommit) -> None:
        """Write ``effects`` once the chunk is committed, in the run's task. Called by
        whoever started the run before its next await: a chunk commits only after
        engine steps, which need the event loop, so it cannot have committed yet."""
        if self.committed:
            raise RuntimeError("on_commit after the chunk was committed: its effects would be lost")
        self.after_commit = effects

    def cancel(self) -> None:
        """Undo the chunk: its engine request is aborted and the session, parked, is as
        it was before it. A committed chunk is kept (its effects are being written)."""
        if not self.committed:
            self._task.cancel()

    async def events(self) -> AsyncGenerator[ChunkEvent, None]:
        """Deltas, then the result; raises what ended the chunk (an ``APIError``).
        The result comes once the run has ended and released its session, so a client
        that answers it at once finds the session free. A consumer that stops reading
        before the end cancels the chunk."""
        finished = False
        result: ChunkResult | None = None
        try:
            while True:
                event = await self._events.get()
                if event is _END:
                    finished = True
                    # The end is told once the session is free again (the store's part
                    # of a release can hold it a moment longer).
                    await asyncio.shield(self.released)
                    if not self._events.empty():
                        raise self._events.get_nowait()  # type: ignore[misc]
                    if self._task.cancelled() or result is None:
                        # Cancelled by someone else than this consumer: a server stop,
                        # a close, or the connection that started it.
                        raise chunk_undone()
                    yield result
                    return
                if isinstance(event, ChunkResult):
                    result = event
                else:
                    yield event  # type: ignore[misc]
        finally:
            if not finished:
                self.cancel()
            if not self.delivered.done():
                self.delivered.set_result(None)

    async def result(self) -> ChunkResult:
        """The chunk's result, once it has run; cancelling the caller cancels the chunk."""
        async with contextlib.aclosing(self.events()) as events:
            async for event in events:
                if isinstance(event, ChunkResult):
                    return event
        raise AssertionError("events() ends with the result or raises")
