"""One Realtime websocket connection: read client events, answer bad ones with an
``error`` event (the session stays usable), send server events one at a time."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import WebSocket, WebSocketDisconnect
from openai.types import realtime as rt
from pydantic import BaseModel

from app.errors import APIError
from app.realtime.protocol import ClientEventError, dump, new_id, parse_client_event
from app.realtime.serving import Conversation
from app.sessions.service import SessionService
from app.sessions.session import StreamingSession

logger = logging.getLogger(__name__)


class RealtimeConnection:
    def __init__(self, websocket: WebSocket, service: SessionService, owner: str, session: StreamingSession,
                 owns_session: bool):
        self.websocket = websocket
        self.service = service
        self.owner = owner
        self.owns_session = owns_session  # a session opened here ends with the connection
        self._send_lock = asyncio.Lock()
        self._connection_id = new_id("conn")
        self.conversation = Conversation(service, owner, session, service.tokenizer, self.send)

    async def send(self, event: BaseModel) -> None:
        async with self._send_lock:
            try:
                await self.websocket.send_text(dump(event))
            except (WebSocketDisconnect, RuntimeError):
                logger.debug("realtime %s: connection closed, event dropped", self.conversation.session.id)

    async def send_error(self, error: ClientEventError) -> None:
        await self.send(rt.RealtimeErrorEvent(
            type="error", event_id=self.conversation.event_id(),
            error=rt.RealtimeError(type="invalid_request_error", code=error.code, message=error.message,
                                   param=error.param, event_id=error.event_id),
        ))

    async def run(self) -> None:
        conversation = self.conversation
        await self.send(rt.SessionCreatedEvent(type="session.created", event_id=conversation.event_id(),
                                               session=conversation.session_config()))
        try:
            while True:
                try:
                    raw = await self.websocket.receive_text()
                except (WebSocketDisconnect, RuntimeError):
                    return
                except KeyError:  # a binary frame
                    await self.send_error(ClientEventError("Client events are JSON text frames.", "invalid_event"))
                    continue
                try:
                    await self._admit_event()
                    await self.handle(raw)
                except ClientEventError as error:
                    await self.send_error(error)
        finally:
            await conversation.close()
            if self.owns_session and not conversation.session.closed:
                await self.service.close(self.owner, conversation.session.id, reason="connection_closed")

    async def _admit_event(self) -> None:
        """The per-connection event rate (frame size is uvicorn's ws_max_size)."""
        try:
            await self.service.limits.admit_event(self.owner, self._connection_id)
        except APIError as exc:
            raise ClientEventError(exc.message, exc.code) from None

    async def handle(self, raw: str) -> None:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ClientEventError(f"Invalid JSON: {exc.msg}.", "invalid_json") from None
        except (ValueError, RecursionError):  # an int past Python's digit limit, nested too deep
            raise ClientEventError("Invalid JSON: too deeply nested, or a number too long.", "invalid_json") from None
        event = parse_client_event(data)
        conversation = self.conversation
        if isinstance(event, rt.SessionUpdateEvent):
            await conversation.update_session(event)
        elif isinstance(event, rt.ConversationItemCreateEvent):
            await conversation.add_item(event)
        elif isinstance(event, rt.ConversationItemRetrieveEvent):
            await conversation.retrieve_item(event)
        elif isinstance(event, rt.ResponseCreateEvent):
            await conversation.create_response(event)
        elif isinstance(event, rt.ResponseCancelEvent):
            await conversation.cancel_response(event)
