"""Server-sent events for a chunk's answer, shared by the routes that stream one.

The frames come from an async iterator that runs in its own task from the start (a
chunk's ``ChunkRun`` already runs in its own), so whatever the iterator holds is
released even if the response never begins. The headers wait for the first frames and
go out with them (one write: a short answer's whole stream is one). If the client goes
away, the producer is cancelled, which closes the iterator (a chunk's ``events()``
then undoes the chunk). Starlette's StreamingResponse watches for the disconnect through
an anyio task group around the stream; one listener task does the same here for less.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from app.http.disconnect import cancel_on_disconnect


class EventStream(StreamingResponse):
    def __init__(self, frames: AsyncIterator[str]) -> None:
        super().__init__(
            self._frames(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._producer = asyncio.create_task(self._produce(frames))

    async def _produce(self, frames: AsyncIterator[str]) -> None:
        try:
            async with contextlib.aclosing(frames):  # type: ignore[type-var]
                async for frame in frames:
                    self._queue.put_nowait(frame)
        finally:
            self._queue.put_nowait(None)

    async def _frames(self) -> AsyncIterator[bytes]:
        """Frames that are ready go out in one write (a chunk's last delta, its done
        event and its end usually arrive together)."""
        ended = False
        while not ended:
            ready = [await self._queue.get()]
            while not self._queue.empty():
                ready.append(self._queue.get_nowait())
            if None in ready:
                ended, ready = True, ready[: ready.index(None)]
            if ready:
                yield "".join(frame for frame in ready if frame is not None).encode()

    async def _stop_producer(self) -> None:
        if not self._producer.done():
            self._producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._producer

    async def stream_response(self, send: Any) -> None:
        start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        started = False
        async for frames in self.body_iterator:
            if not started:  # in the same tick as the first frames: one write
                await send(start)
                started = True
            await send({"type": "http.response.body", "body": frames, "more_body": True})
        if not started:
            await send(start)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # The producer's last frames end the stream when the client leaves.
        listener = asyncio.create_task(cancel_on_disconnect(receive, self._producer))
        try:
            await self.stream_response(send)
        finally:
            listener.cancel()
            await self._stop_producer()
