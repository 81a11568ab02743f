"""Thin REST transport over SessionService."""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Header, Request
from fastapi.responses import Response
from starlette.types import Receive, Scope

from app.api.deps import OwnerDep, RouteKeyDep, ServiceDep
from app.api.sessions.protocol import (
    ChunkDeltaEvent,
    ChunkDoneEvent,
    ChunkOutput,
    ChunkRequest,
    ChunkResponse,
    SessionDeleted,
    SessionList,
    TranscriptResponse,
)
from app.errors import APIError, OpenAIErrorBody
from app.http.auth import owner_of
from app.http.disconnect import unless_disconnected
from app.http.sse import EventStream
from app.protocol import SESSION_ID_PATTERN, SessionCreateRequest, SessionObject
from app.sessions import errors
from app.sessions.chunk import ChunkResult
from app.sessions.run import ChunkRun
from app.sessions.service import SessionService

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
    route_key: RouteKeyDep,
    body: SessionCreateRequest | None = None,
    x_session_id: Annotated[
        str | None,
        Header(description="Choose the session id (for session-affine proxies).", pattern=SESSION_ID_PATTERN),
    ] = None,
) -> SessionObject:
    """Open a streaming-input session. Optional body: per-session sampling defaults and metadata."""
    session = await service.create(owner, body or SessionCreateRequest(), session_id=x_session_id, route_key=route_key)
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
    return await chunk_answer(service, owner, session_id, body, request.receive)


async def direct_chunk_answer(scope: Scope, receive: Receive, session_id: str, body: ChunkRequest) -> Response:
    """``append_chunk`` as app.http.direct_route serves it, without FastAPI."""
    return await chunk_answer(scope["app"].state.session_service, owner_of(scope), session_id, body, receive)


async def chunk_answer(
    service: SessionService, owner: str, session_id: str, body: ChunkRequest, receive: Receive
) -> Response:
    run = await service.start_chunk(
        owner,
        session_id,
        body.input,
        body,
        transport="sse" if body.stream else "rest",
        wait=False,
        generate=body.generate,
    )
    chunk_id = f"chunk_{secrets.token_hex(12)}"
    if body.stream:
        return EventStream(_chunk_frames(run, chunk_id))
    result = await unless_disconnected(receive, run)
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


async def _chunk_frames(run: ChunkRun, chunk_id: str) -> AsyncIterator[str]:
    """One chunk's answer as server-sent events, then ``[DONE]``."""
    session_id = run.session.id
    try:
        async with contextlib.aclosing(run.events()) as events:
            async for event in events:
                payload: ChunkDoneEvent | ChunkDeltaEvent
                if isinstance(event, ChunkResult):
                    payload = ChunkDoneEvent(
                        id=chunk_id,
                        session_id=session_id,
                        index=event.index,
                        finish_reason=event.finish_reason,
                        usage=event.usage,
                    )
                else:
                    payload = ChunkDeltaEvent(
                        id=chunk_id,
                        session_id=session_id,
                        index=run.session.num_chunks,
                        delta=ChunkOutput(text=event.text, token_ids=event.token_ids),
                    )
                yield f"data: {payload.model_dump_json()}\n\n"
    except APIError as exc:
        # Headers are gone already: the error travels as an SSE event.
        yield f"data: {json.dumps(exc.body())}\n\n"
    yield "data: [DONE]\n\n"
