"""One shape for every websocket protocol here (the session events, the Realtime API,
the Responses websocket): a reader and its workers.

The reader takes each text frame the key's event rate admits (``EventChannel``), parses
its JSON once (``parse_event``) and hands it to the protocol's ``receive``, which
answers at once what it can (checks, small updates) and gives what may wait (a chunk,
a response) to a ``Worker``: one task that runs its jobs one at a time, in order, so
the reader goes on reading, and sees a disconnect, while the model answers. Whatever
is refused becomes the protocol's own error event (``error_frame``) and the connection
and its session go on. A connection refused on accept gets that error event and a
close code that says whether to come back (``refuse_connection``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

from fastapi import WebSocket, WebSocketDisconnect

from app.errors import APIError
from app.limits import KeyLimits

logger = logging.getLogger(__name__)

# uvicorn closes every websocket with 1012 (service restart) when the server stops:
# such a disconnect is the server going away, not the client.
SERVER_STOPPING = 1012
# Jobs a worker holds behind the one running; more is a client bug, not a queue.
MAX_QUEUED_JOBS = 64
Job = TypeVar("Job")


def refusal_close_code(error: APIError) -> int:
    """How a connection refused on accept is closed: 1012 (service restart: reconnect,
    another replica takes the session) for a draining server, 1008 (policy) for the
    client's error, 1011 for the server's."""
    if error.code == "server_draining":
        return SERVER_STOPPING
    return 1008 if error.status < 500 else 1011


async def refuse_connection(websocket: WebSocket, error: APIError, frame: str) -> None:
    """Refuse an accepted connection: ``frame`` (the protocol's error event), then the close."""
    await websocket.send_text(frame)
    await websocket.close(code=refusal_close_code(error), reason=error.code)


def parse_event(raw: str) -> Any:
    """A client event's JSON; a 400 ``invalid_json`` if it is none (or an int past
    Python's digit limit, or nested too deep)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise APIError(400, "The event is not valid JSON.", code="invalid_json") from None


class EventChannel:
    def __init__(
        self, websocket: WebSocket, limits: KeyLimits, owner: str, refuse: Callable[[APIError], Awaitable[None]]
    ) -> None:
        self.websocket = websocket
        self._limits = limits
        self._owner = owner
        self._refuse = refuse  # answers a frame that is not taken, as the protocol's error event
        self._send_lock = asyncio.Lock()
        self.connection_id = f"conn_{secrets.token_hex(8)}"
        # Whether the connection ended because the server is stopping.
        self.server_stopping = False

    async def send_text(self, text: str) -> None:
        async with self._send_lock:
            try:
                await self.websocket.send_text(text)
            except (WebSocketDisconnect, RuntimeError):
                # The client went away; the read loop sees the disconnect and ends.
                logger.debug("%s: connection closed, event dropped", self.connection_id)

    async def frames(self) -> AsyncIterator[str]:
        """Each text frame the key's event rate admits; others are refused (and the
        connection stays open). Ends when either side closes the connection."""
        while True:
            try:
                raw = await self.websocket.receive_text()
            except WebSocketDisconnect as exc:
                self.server_stopping = exc.code == SERVER_STOPPING
                return
            except RuntimeError:  # the socket was closed by our side
                return
            except KeyError:  # a binary frame
                await self._refuse(APIError(400, "Client events are JSON text frames.", code="invalid_event"))
                continue
            try:
                await self._limits.admit_event(self._owner, self.connection_id)
            except APIError as exc:
                await self._refuse(exc)
                continue
            yield raw


class Worker(Generic[Job]):
    """Jobs run one at a time, in order, in a task of their own. A job that fails with
    an ``APIError`` is answered by ``failed`` and the next one runs."""

    def __init__(
        self,
        run: Callable[[Job], Awaitable[None]],
        failed: Callable[[Job, APIError], Awaitable[None]],
        name: str,
        limit: int = MAX_QUEUED_JOBS,
    ) -> None:
        self._run, self._failed = run, failed
        self._jobs: asyncio.Queue[Job] = asyncio.Queue(limit)
        self._task = asyncio.create_task(self._work(), name=name)

    def submit(self, job: Job) -> None:
        if self._jobs.full():
            raise APIError(429, "Too many requests queued on this connection.", code="too_many_queued_appends")
        self._jobs.put_nowait(job)

    async def _work(self) -> None:
        while True:
            job = await self._jobs.get()
            try:
                await self._run(job)
            except APIError as error:
                await self._failed(job, error)

    async def close(self) -> None:
        """Cancel the job running (its chunk is undone) and drop those queued."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class EventConnection:
    """One websocket connection: ``run`` reads until either side closes, then stops the
    workers and calls ``closed``. A protocol defines ``error_frame``, ``receive``, and
    what happens when it opens and closes."""

    def __init__(self, websocket: WebSocket, limits: KeyLimits, owner: str) -> None:
        self.websocket = websocket
        self.owner = owner
        self.channel = EventChannel(websocket, limits, owner, self.send_error)
        self._workers: list[Worker[Any]] = []

    def error_frame(self, error: APIError, about: str | None) -> str:
        """The protocol's error event for ``error``; ``about``: what it answers (the
        client event's id, or the protocol's stream)."""
        raise NotImplementedError

    async def receive(self, event: Any) -> None:
        """One client event, parsed: raise an ``APIError`` to answer with an error event."""
        raise NotImplementedError

    def about(self, event: Any) -> str | None:
        """What an error in answer to ``event`` names: its ``event_id`` by default."""
        event_id = event.get("event_id") if isinstance(event, dict) else None
        return event_id if isinstance(event_id, str) else None

    async def opened(self) -> None:
        """Before the first frame is read."""

    async def closed(self) -> None:
        """Once the reading is over and every worker stopped."""

    def worker(
        self, run: Callable[[Job], Awaitable[None]], failed: Callable[[Job, APIError], Awaitable[None]], name: str
    ) -> Worker[Job]:
        worker = Worker(run, failed, f"{name}-{self.channel.connection_id}")
        self._workers.append(worker)
        return worker

    async def send(self, frame: str) -> None:
        await self.channel.send_text(frame)

    async def send_error(self, error: APIError, about: str | None = None) -> None:
        await self.send(self.error_frame(error, about if about is not None else error.event_id))

    async def run(self) -> None:
        await self.opened()
        try:
            async for raw in self.channel.frames():
                event: Any = None
                try:
                    event = parse_event(raw)
                    await self.receive(event)
                except APIError as error:
                    await self.send_error(error, error.event_id if error.event_id is not None else self.about(event))
        finally:
            for worker in self._workers:
                await worker.close()
            await self.closed()
