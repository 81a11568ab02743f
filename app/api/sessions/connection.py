"""One websocket connection driving one session (OpenAI Realtime-style events), in the
shape every websocket here has (``app.http.websocket.EventConnection``): the reader
answers bad events with an ``error`` event, so the connection and the session stay
usable; appends run one at a time, in order, in the connection's worker, so the reader
keeps reading (and notices a disconnect or a ``session.close``) while a chunk generates.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import TypeAdapter, ValidationError

from app.api.sessions.protocol import (
    ChunkOutput,
    ClientEvent,
    ErrorDetail,
    ErrorEvent,
    InputAppendEvent,
    ResponseDoneEvent,
    ResponseOutputDeltaEvent,
    ServerEvent,
    SessionClosedEvent,
    SessionCloseEvent,
    SessionCreatedEvent,
    SessionUpdatedEvent,
    SessionUpdateEvent,
)
from app.errors import APIError, error_param, most_specific
from app.http.websocket import EventConnection
from app.limits import KeyLimits
from app.sessions.chunk import ChunkResult
from app.sessions.service import SessionService
from app.sessions.session import StreamingSession

_client_events: TypeAdapter[Any] = TypeAdapter(ClientEvent)


class SessionConnection(EventConnection):
    def __init__(
        self,
        websocket: WebSocket,
        service: SessionService,
        limits: KeyLimits,
        owner: str,
        session: StreamingSession,
        owns_session: bool,
    ):
        super().__init__(websocket, limits, owner)
        self.service = service
        self.limits = limits
        self.session = session
        # A session created by this connection ends with it; an attached one stays.
        self.owns_session = owns_session
        self._event_ids = itertools.count()
        self._appends = self.worker(self._append, self._append_failed, f"ws-appends-{session.id}")

    def _event_id(self) -> str:
        return f"event_{next(self._event_ids)}"

    async def send_event(self, event: ServerEvent) -> None:
        await self.send(event.model_dump_json())

    def error_frame(self, error: APIError, about: str | None) -> str:
        return error_event(error, self._event_id(), about).model_dump_json()

    async def opened(self) -> None:
        description = self.service.describe(self.session)
        created = self.owns_session  # a session this connection opened is announced as created
        event = SessionCreatedEvent if created else SessionUpdatedEvent
        await self.send_event(event(event_id=self._event_id(), session=description))

    async def closed(self) -> None:
        # A server stop is not the client leaving: the session is parked, not closed.
        client_left = not (self.channel.server_stopping or self.service.stopping)
        if self.owns_session and client_left and not self.session.closed:
            await self.service.close(self.owner, self.session.id, reason="connection_closed")

    async def receive(self, data: Any) -> None:
        event = _parse(data)
        if isinstance(event, InputAppendEvent):
            try:
                await self.limits.admit_request(self.owner)
                self._appends.submit(event)
            except APIError as exc:
                exc.event_id = event.event_id
                raise
        elif isinstance(event, SessionUpdateEvent):
            try:
                session = await self.service.update_defaults(self.owner, self.session.id, event.session)
            except APIError as exc:
                exc.event_id = event.event_id
                raise
            await self.send_event(
                SessionUpdatedEvent(event_id=self._event_id(), session=self.service.describe(session))
            )
        elif isinstance(event, SessionCloseEvent):
            if not self.session.closed:
                await self.service.close(self.owner, self.session.id, reason="closed_by_client")
            await self.send_event(SessionClosedEvent(event_id=self._event_id(), reason="closed_by_client"))
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await self.websocket.close(1000)

    async def _append_failed(self, event: InputAppendEvent, error: APIError) -> None:
        await self.send_error(error, event.event_id)
        if self.session.closed:
            await self.send_event(
                SessionClosedEvent(event_id=self._event_id(), reason=self.session.close_reason or "closed")
            )

    async def _append(self, event: InputAppendEvent) -> None:
        run = await self.service.start_chunk(
            self.owner,
            self.session.id,
            event.input,
            event,
            transport="websocket",
            wait=True,
            generate=event.generate,
        )
        async with contextlib.aclosing(run.events()) as events:
            async for item in events:
                if isinstance(item, ChunkResult):
                    await self.send_event(
                        ResponseDoneEvent(
                            event_id=self._event_id(),
                            chunk_index=item.index,
                            finish_reason=item.finish_reason,
                            output=ChunkOutput(text=item.text, token_ids=item.token_ids),
                            usage=item.usage,
                        )
                    )
                else:
                    await self.send_event(
                        ResponseOutputDeltaEvent(
                            event_id=self._event_id(),
                            chunk_index=self.session.num_chunks,
                            delta=ChunkOutput(text=item.text, token_ids=item.token_ids),
                        )
                    )


def error_event(error: APIError, event_id: str, about: str | None = None) -> ErrorEvent:
    """The session protocol's error event; ``about``: the client event it answers."""
    return ErrorEvent(
        event_id=event_id,
        error=ErrorDetail(type=error.type, code=error.code, message=error.message, param=error.param, event_id=about),
    )


def _parse(data: Any) -> Any:
    client_event_id = data.get("event_id") if isinstance(data, dict) else None
    try:
        return _client_events.validate_python(data)
    except ValidationError as exc:
        first = most_specific(exc.errors())
        param = error_param(first.get("loc"))
        if isinstance(data, dict) and first.get("type") in ("union_tag_invalid", "union_tag_not_found"):
            message = (
                f"Unknown event type {data.get('type')!r}; expected session.update, input.append or session.close."
            )
            param = "type"
        else:
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        raise APIError(
            400,
            message,
            code="invalid_event",
            param=param,
            event_id=client_event_id if isinstance(client_event_id, str) else None,
        ) from None
