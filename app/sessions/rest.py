"""Thin REST transport over SessionService."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Header, Request
from fastapi.responses import Response, StreamingResponse

from app.deps import OwnerDep, ServiceDep
from app.errors import APIError, OpenAIErrorBody
from app.sessions import errors
from app.sessions.protocol import (
    SESSION_ID_PATTERN,
    ChunkDeltaEvent,
    ChunkDoneEvent,
    ChunkOutput,
    ChunkRequest,
    ChunkResponse,
    SessionCreateRequest,
    SessionDeleted,
    SessionList,
    SessionObject,
    TranscriptResponse,
)
from app.sessions.run import ChunkRun
from app.sessions.session import ChunkResult
from app.transport.disconnect import cancel_on_disconnect

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": description, "model": OpenAIErrorBody}
    for status, description in {
        400: "Invalid request",
        401: "Missing or invalid API key",
        404: "Unknown session",
        409: "Session closed, or a chunk already in flight",
        413: "Request body too large",
        429: "Rate limit of the API key, or the server's session limit, reached (with Retry-After)",
        503: "No room on the device for this chunk now (server_busy), the store or the engine unavailable "
        "(with Retry-After)",
    }.items()
}

T = TypeVar("T")


@router.post("", status_code=201, response_model=SessionObject, responses=ERROR_RESPONSES)
async def create_session(
    service: ServiceDep,
    owner: OwnerDep,
    body: SessionCreateRequest | None = None,
    x_session_id: Annotated[
        str | None,
        Header(description="Choose the session id (for session-affine proxies).", pattern=SESSION_ID_PATTERN),
    ] = None,
) -> SessionObject:
    """Open a streaming-input session. Optional body: per-session sampling defaults and metadata."""
    session = await service.create(owner, body or SessionCreateRequest(), session_id=x_session_id)
    return service.describe(session)


@router.get("", response_model=SessionList, responses=ERROR_RESPONSES)
async def list_sessions(service: ServiceDep, owner: OwnerDep) -> SessionList:
    """The caller's open sessions."""
    return SessionList(data=await service.list_sessions(owner))


@router.get("/{session_id}", response_model=SessionObject, responses=ERROR_RESPONSES)
async def get_session(session_id: str, service: ServiceDep, owner: OwnerDep) -> SessionObject:
    """A session's state: status, token and chunk counts, times."""
    return service.describe(await service.current(owner, session_id))


@router.get("/{session_id}/transcript", response_model=TranscriptResponse, responses=ERROR_RESPONSES)
async def get_transcript(session_id: str, service: ServiceDep, owner: OwnerDep) -> TranscriptResponse:
    """The context the engine holds for the session, as token ids and text. A request
    that starts with these token ids reuses the session's KV (device or CPU tier)."""
    session, text = await service.transcript(owner, session_id)
    return TranscriptResponse(
        session_id=session.id, token_ids=list(session.token_ids), text=text, num_tokens=len(session.token_ids)
    )


@router.post("/{session_id}/park", response_model=SessionObject, responses=ERROR_RESPONSES)
async def park_session(session_id: str, service: ServiceDep, owner: OwnerDep) -> SessionObject:
    """Park an idle session now: its engine request ends and frees its device slot and
    KV, which the CPU tier keeps; its next chunk resumes it. The server also parks idle
    sessions by itself (after ``session_park_after_s``, or when the device is full).
    A session that is answering a chunk, or holds no engine request, is left as it is."""
    return service.describe(await service.park(owner, session_id))


@router.delete("/{session_id}", response_model=SessionDeleted, responses=ERROR_RESPONSES)
async def delete_session(session_id: str, service: ServiceDep, owner: OwnerDep) -> SessionDeleted:
    """Close a session and free its device KV (what was offloaded stays in the CPU tier)."""
    session = await service.close(owner, session_id, reason=errors.DELETED)
    return SessionDeleted(id=session.id)


@router.post(
    "/{session_id}/chunks",
    response_model=ChunkResponse,
    responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}},
)
async def append_chunk(
    session_id: str, body: ChunkRequest, request: Request, service: ServiceDep, owner: OwnerDep
) -> Response:
    """Append one input chunk and generate after it: one JSON body, or SSE with ``stream``."""
    run = await service.start_chunk(
        owner, session_id, body.input, body, transport="sse" if body.stream else "rest", wait=False
    )
    chunk_id = f"chunk_{secrets.token_hex(12)}"
    if body.stream:
        return ChunkEventStream(run, chunk_id)
    result = await _unless_disconnected(request, run.result())
    answer = ChunkResponse(
        id=chunk_id,
        session_id=session_id,
        index=result.index,
        output=ChunkOutput(text=result.text, token_ids=result.token_ids),
        finish_reason=result.finish_reason,
        usage=result.usage,
    )
    # Serialized here, in pydantic's core: FastAPI would validate the model again
    # against response_model and encode it through jsonable_encoder and json.dumps.
    return Response(answer.model_dump_json(), media_type="application/json")


class ChunkEventStream(StreamingResponse):
    """One chunk's answer as server-sent events.

    The chunk runs in its own task (a ``ChunkRun``) from the start, so its lock is
    released even if the response never begins. The headers wait for the first events and go out with
    them (one write: a short chunk's whole answer, headers to ``[DONE]``, is one).
    If the client goes away, the chunk's task is cancelled, which aborts its engine
    request and undoes the chunk. (Starlette's StreamingResponse watches for the
    disconnect through an anyio task group around the stream; one listener task
    that cancels the chunk does the same here for less.)"""

    def __init__(self, run: ChunkRun, chunk_id: str) -> None:
        super().__init__(self._frames(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._producer = asyncio.create_task(self._produce(run, chunk_id))

    async def _produce(self, run: ChunkRun, chunk_id: str) -> None:
        session_id = run.session.id
        try:
            async with contextlib.aclosing(run.events()) as events:
                async for event in events:
                    payload: ChunkDoneEvent | ChunkDeltaEvent
                    if isinstance(event, ChunkResult):
                        payload = ChunkDoneEvent(
                            id=chunk_id, session_id=session_id, index=event.index,
                            finish_reason=event.finish_reason, usage=event.usage,
                        )
                    else:
                        payload = ChunkDeltaEvent(
                            id=chunk_id, session_id=session_id, index=run.session.num_chunks,
                            delta=ChunkOutput(text=event.text, token_ids=event.token_ids),
                        )
                    self._queue.put_nowait(f"data: {payload.model_dump_json()}\n\n")
        except APIError as exc:
            # Headers are gone already: the error travels as an SSE event.
            self._queue.put_nowait(f"data: {json.dumps(exc.body())}\n\n")
        finally:
            self._queue.put_nowait("data: [DONE]\n\n")
            self._queue.put_nowait(None)

    async def _frames(self) -> AsyncIterator[bytes]:
        """Frames that are ready go out in one write (a chunk's last delta, its done
        event and [DONE] usually arrive together)."""
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


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first, so an abandoned
    chunk aborts its engine request instead of running on."""
    task = asyncio.ensure_future(work)
    listener = asyncio.create_task(cancel_on_disconnect(request.receive, task))
    try:
        return await task
    except asyncio.CancelledError:
        if listener.done() and not listener.cancelled():
            raise APIError(499, "The client closed the connection.", code="client_disconnected") from None
        raise
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
