"""One websocket connection driving one session (OpenAI Realtime-style events).

The reader parses client events and answers bad ones with an ``error`` event, so
the connection and the session stay usable. Appends run one at a time, in order,
in a worker task, so the reader keeps reading (and notices a disconnect or a
``session.close``) while a chunk generates.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
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
from app.http.websocket import EventChannel
from app.limits import KeyLimits
from app.sessions.chunk import ChunkResult
from app.sessions.service import SessionService
from app.sessions.session import StreamingSession

_client_events: TypeAdapter[Any] = TypeAdapter(ClientEvent)
# Appends waiting behind the one generating; more is a client bug, not a queue.
MAX_QUEUED_APPENDS = 64


class SessionConnection:
    def __init__(self, websocket: WebSocket, service: SessionService, limits: KeyLimits, owner: str,
                 session: StreamingSession, owns_session: bool):
        self.websocket = websocket
        self.service = service
        self.limits = limits
        self.owner = owner
        self.session = session
        # A session created by this connection ends with it; an attached one stays.
        self.owns_session = owns_session
        self._event_ids = itertools.count()
        self._appends: asyncio.Queue[InputAppendEvent] = asyncio.Queue(MAX_QUEUED_APPENDS)
        self.channel = EventChannel(websocket, limits, owner, self.send_error)

    def _event_id(self) -> str:
        return f"event_{next(self._event_ids)}"

    async def send(self, event: ServerEvent) -> None:
        await self.channel.send_text(event.model_dump_json())

    async def send_error(self, error: APIError, client_event_id: str | None = None) -> None:
        await self.send(
            ErrorEvent(
                event_id=self._event_id(),
                error=ErrorDetail(
                    type=error.type, code=error.code, message=error.message, param=error.param,
                    event_id=client_event_id,
                ),
            )
        )

    async def run(self, created: bool) -> None:
        description = self.service.describe(self.session)
        if created:
            await self.send(SessionCreatedEvent(event_id=self._event_id(), session=description))
        else:
            await self.send(SessionUpdatedEvent(event_id=self._event_id(), session=description))
        worker = asyncio.create_task(self._run_appends(), name=f"ws-appends-{self.session.id}")
        try:
            await self._read_events()
        finally:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
            # A server stop is not the client leaving: the session is parked, not closed.
            client_left = not (self.channel.server_stopping or self.service.stopping)
            if self.owns_session and client_left and not self.session.closed:
                await self.service.close(self.owner, self.session.id, reason="connection_closed")

    async def _read_events(self) -> None:
        async for raw in self.channel.frames():
            event = await self._parse(raw)
            if event is None:
                continue
            if isinstance(event, InputAppendEvent):
                try:
                    await self.limits.admit_request(self.owner)
                except APIError as exc:
                    await self.send_error(exc, event.event_id)
                    continue
                if self._appends.full():
                    await self.send_error(
                        APIError(429, "Too many appends queued on this connection.", code="too_many_queued_appends"),
                        event.event_id,
                    )
                else:
                    self._appends.put_nowait(event)
            elif isinstance(event, SessionUpdateEvent):
                try:
                    session = await self.service.update_defaults(self.owner, self.session.id, event.session)
                except APIError as exc:
                    await self.send_error(exc, event.event_id)
                else:
                    await self.send(SessionUpdatedEvent(event_id=self._event_id(), session=self.service.describe(session)))
            elif isinstance(event, SessionCloseEvent):
                if not self.session.closed:
                    await self.service.close(self.owner, self.session.id, reason="closed_by_client")
                await self.send(SessionClosedEvent(event_id=self._event_id(), reason="closed_by_client"))
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                    await self.websocket.close(1000)
                return

    async def _parse(self, raw: str) -> Any:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, an int past Python's digit limit, nested too deep
            await self.send_error(APIError(400, "The event is not valid JSON.", code="invalid_json"))
            return None
        client_event_id = data.get("event_id") if isinstance(data, dict) else None
        try:
            return _client_events.validate_python(data)
        except ValidationError as exc:
            first = most_specific(exc.errors())
            param = error_param(first.get("loc"))
            if isinstance(data, dict) and first.get("type") in ("union_tag_invalid", "union_tag_not_found"):
                message = f"Unknown event type {data.get('type')!r}; expected session.update, input.append or session.close."
                param = "type"
            else:
                message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
            await self.send_error(APIError(400, message, code="invalid_event", param=param), client_event_id)
            return None

    async def _run_appends(self) -> None:
        while True:
            event = await self._appends.get()
            try:
                await self._append(event)
            except APIError as exc:
                await self.send_error(exc, event.event_id)
                if self.session.closed:
                    await self.send(SessionClosedEvent(event_id=self._event_id(), reason=self.session.close_reason or "closed"))

    async def _append(self, event: InputAppendEvent) -> None:
        run = await self.service.start_chunk(
            self.owner, self.session.id, event.input, event, transport="websocket", wait=True,
            generate=event.generate,
        )
        async with contextlib.aclosing(run.events()) as events:
            async for item in events:
                if isinstance(item, ChunkResult):
                    await self.send(
                        ResponseDoneEvent(
                            event_id=self._event_id(),
                            chunk_index=item.index,
                            finish_reason=item.finish_reason,
                            output=ChunkOutput(text=item.text, token_ids=item.token_ids),
                            usage=item.usage,
                        )
                    )
                else:
                    await self.send(
                        ResponseOutputDeltaEvent(
                            event_id=self._event_id(),
                            chunk_index=self.session.num_chunks,
                            delta=ChunkOutput(text=item.text, token_ids=item.token_ids),
                        )
                    )
