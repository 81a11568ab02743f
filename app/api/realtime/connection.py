"""One Realtime websocket connection: read client events, answer bad ones with an
``error`` event (the session stays usable), send server events one at a time."""

from __future__ import annotations

import json

from fastapi import WebSocket
from openai.types import realtime as rt
from pydantic import BaseModel

from app.api.realtime.protocol import ClientEventError, dump, parse_client_event
from app.api.realtime.serving import RealtimeService
from app.errors import APIError
from app.http.websocket import EventChannel
from app.limits import KeyLimits
from app.sessions.session import StreamingSession


class RealtimeConnection:
    def __init__(self, websocket: WebSocket, realtime: RealtimeService, limits: KeyLimits, owner: str,
                 session: StreamingSession, owns_session: bool):
        self.websocket = websocket
        self.service = realtime.sessions
        self.limits = limits
        self.owner = owner
        self.owns_session = owns_session  # a session opened here ends with the connection
        self.channel = EventChannel(websocket, limits, owner, self._refuse)
        self.conversation = realtime.conversation(owner, session, self.send)

    async def send(self, event: BaseModel) -> None:
        await self.channel.send_text(dump(event))

    async def _refuse(self, error: APIError) -> None:
        await self.send_error(ClientEventError(error.message, error.code))

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
            async for raw in self.channel.frames():
                try:
                    await self.handle(raw)
                except ClientEventError as error:
                    await self.send_error(error)
        finally:
            await conversation.close()
            # A server stop is not the client leaving: the session is parked, not closed.
            client_left = not (self.channel.server_stopping or self.service.stopping)
            if self.owns_session and client_left and not conversation.session.closed:
                await self.service.close(self.owner, conversation.session.id, reason="connection_closed")

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
            try:
                await self.limits.admit_request(self.owner)  # a response counts as a request
            except APIError as exc:
                raise ClientEventError(exc.message, exc.code, exc.param, event.event_id) from None
            await conversation.create_response(event)
        elif isinstance(event, rt.ResponseCancelEvent):
            await conversation.cancel_response(event)
