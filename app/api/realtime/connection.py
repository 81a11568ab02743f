"""One Realtime websocket connection, in the shape every websocket here has
(``app.http.websocket.EventConnection``): the reader answers bad events with an
``error`` event (the session stays usable) and hands each response to the connection's
worker, which starts its chunk and streams it, so the reader keeps reading
(``response.cancel``, a disconnect) while the model answers."""

from __future__ import annotations

from typing import Any

from fastapi import WebSocket
from openai.types import realtime as rt
from pydantic import BaseModel

from app.api.realtime.protocol import ClientEventError, dump, error_event, parse_client_event
from app.api.realtime.serving import PlannedResponse, RealtimeService
from app.errors import APIError
from app.http.websocket import EventConnection
from app.limits import KeyLimits
from app.sessions.session import StreamingSession


class RealtimeConnection(EventConnection):
    def __init__(
        self,
        websocket: WebSocket,
        realtime: RealtimeService,
        limits: KeyLimits,
        owner: str,
        session: StreamingSession,
        owns_session: bool,
    ):
        super().__init__(websocket, limits, owner)
        self.service = realtime.sessions
        self.limits = limits
        self.owns_session = owns_session  # a session opened here ends with the connection
        self.conversation = realtime.conversation(owner, session, self.send_model)
        self._responses = self.worker(self.conversation.respond, self._response_failed, f"realtime-{session.id}")

    async def send_model(self, event: BaseModel) -> None:
        await self.send(dump(event))

    def error_frame(self, error: APIError, about: str | None) -> str:
        return dump(error_event(error, self.conversation.event_id(), about))

    async def opened(self) -> None:
        conversation = self.conversation
        await self.send_model(
            rt.SessionCreatedEvent(
                type="session.created", event_id=conversation.event_id(), session=conversation.session_config()
            )
        )

    async def closed(self) -> None:
        conversation = self.conversation
        await conversation.close()
        # A server stop is not the client leaving: the session is parked, not closed.
        client_left = not (self.channel.server_stopping or self.service.stopping)
        if self.owns_session and client_left and not conversation.session.closed:
            await self.service.close(self.owner, conversation.session.id, reason="connection_closed")

    async def receive(self, data: Any) -> None:
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
            self._responses.submit(await conversation.create_response(event))
        elif isinstance(event, rt.ResponseCancelEvent):
            await conversation.cancel_response(event)

    async def _response_failed(self, planned: PlannedResponse, error: APIError) -> None:
        await self.send_error(error, planned.event_id)
