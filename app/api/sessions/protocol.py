"""Wire models of the sessions API alone: its REST bodies, SSE events and websocket
events (the types it shares with the other APIs are ``app.protocol``'s).

Clients import this module too (``clients/``), so it depends on pydantic only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from app.protocol import (
    STRICT,
    ChunkInput,
    ChunkUsage,
    SamplingOptions,
    SessionDefaults,
    SessionObject,
)


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionObject]


class SessionDeleted(BaseModel):
    id: str
    object: Literal["session.deleted"] = "session.deleted"
    deleted: bool = True


GENERATE = Field(
    default=True,
    description="False: append the chunk without an answer (it is computed now, "
    "and the next chunk's answer reads it); the answer has no output. Chat messages are then rendered "
    "without the assistant prefix, which the next chunk of messages adds.",
)


class ChunkRequest(SamplingOptions):
    input: ChunkInput
    stream: bool = False
    generate: bool = GENERATE


class ChunkOutput(BaseModel):
    text: str
    token_ids: list[int]


class ChunkResponse(BaseModel):
    id: str
    object: Literal["session.chunk"] = "session.chunk"
    session_id: str
    index: int
    output: ChunkOutput
    finish_reason: str | None
    usage: ChunkUsage


class ChunkDeltaEvent(BaseModel):
    """One SSE ``data:`` event of a streamed chunk."""

    id: str
    object: Literal["session.chunk.delta"] = "session.chunk.delta"
    session_id: str
    index: int
    delta: ChunkOutput


class ChunkDoneEvent(BaseModel):
    """The last SSE event of a streamed chunk, before ``[DONE]``."""

    id: str
    object: Literal["session.chunk.done"] = "session.chunk.done"
    session_id: str
    index: int
    finish_reason: str | None
    usage: ChunkUsage


class TranscriptResponse(BaseModel):
    object: Literal["session.transcript"] = "session.transcript"
    session_id: str
    token_ids: list[int]
    text: str
    num_tokens: int


class ResetCacheResponse(BaseModel):
    object: Literal["cache.reset"] = "cache.reset"
    device_cache_reset: bool
    cpu_tier_kept: bool = True


# -- websocket: client events ---------------------------------------------------------------


class _ClientEvent(BaseModel):
    model_config = STRICT

    event_id: str | None = Field(default=None, description="Echoed in errors about this event.")


class SessionUpdateEvent(_ClientEvent):
    type: Literal["session.update"]
    session: SessionDefaults


class InputAppendEvent(_ClientEvent, SamplingOptions):
    type: Literal["input.append"]
    input: ChunkInput
    generate: bool = GENERATE


class SessionCloseEvent(_ClientEvent):
    type: Literal["session.close"]


ClientEvent = Annotated[SessionUpdateEvent | InputAppendEvent | SessionCloseEvent, Field(discriminator="type")]

# -- websocket: server events ---------------------------------------------------------------


class _ServerEvent(BaseModel):
    event_id: str


class SessionCreatedEvent(_ServerEvent):
    type: Literal["session.created"] = "session.created"
    session: SessionObject


class SessionUpdatedEvent(_ServerEvent):
    type: Literal["session.updated"] = "session.updated"
    session: SessionObject


class ResponseOutputDeltaEvent(_ServerEvent):
    type: Literal["response.output.delta"] = "response.output.delta"
    chunk_index: int
    delta: ChunkOutput


class ResponseDoneEvent(_ServerEvent):
    type: Literal["response.done"] = "response.done"
    chunk_index: int
    finish_reason: str | None
    output: ChunkOutput
    usage: ChunkUsage


class SessionClosedEvent(_ServerEvent):
    type: Literal["session.closed"] = "session.closed"
    reason: str


class ErrorDetail(BaseModel):
    type: str
    code: str | None
    message: str
    param: str | None = None
    event_id: str | None = Field(default=None, description="The client event this error is about.")


class ErrorEvent(_ServerEvent):
    type: Literal["error"] = "error"
    error: ErrorDetail


ServerEvent = (
    SessionCreatedEvent
    | SessionUpdatedEvent
    | ResponseOutputDeltaEvent
    | ResponseDoneEvent
    | SessionClosedEvent
    | ErrorEvent
)


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
