"""Realtime wire models: the official ``openai`` SDK's own GA types, so that every
frame we send is what the SDK's types describe, plus our parsing of client events.

Server events are built from ``openai.types.realtime`` models; our extension to
``usage.input_token_details`` (where the prompt came from: ``device_tokens``,
``cpu_tier_tokens``, ``computed_tokens``) rides in fields those models allow as
extra. Client events are parsed with the SDK's model of their type.
"""

from __future__ import annotations

import secrets
from typing import Any

from openai.types import realtime as rt
from pydantic import BaseModel, ValidationError

from app.errors import APIError, error_param, most_specific

# The client events we answer, by type, as the SDK models them.
CLIENT_EVENTS: dict[str, type[BaseModel]] = {
    "session.update": rt.SessionUpdateEvent,
    "conversation.item.create": rt.ConversationItemCreateEvent,
    "conversation.item.retrieve": rt.ConversationItemRetrieveEvent,
    "response.create": rt.ResponseCreateEvent,
    "response.cancel": rt.ResponseCancelEvent,
}
SUPPORTED_EVENTS = tuple(CLIENT_EVENTS)
# And those we refuse with an error event (the session goes on).
APPEND_ONLY_EVENTS = ("conversation.item.delete", "conversation.item.truncate")
AUDIO_EVENTS = (
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "output_audio_buffer.clear",
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


class ClientEventError(APIError):
    """A client event we cannot act on (a 400); becomes an ``error`` event."""

    def __init__(self, message: str, code: str, param: str | None = None, event_id: str | None = None):
        super().__init__(400, message, code=code, param=param, event_id=event_id)


def error_event(error: APIError, event_id: str, about: str | None = None) -> rt.RealtimeErrorEvent:
    """The Realtime API's error event; ``about``: the client event it answers."""
    return rt.RealtimeErrorEvent(
        type="error",
        event_id=event_id,
        error=rt.RealtimeError(
            type=error.type, code=error.code, message=error.message, param=error.param, event_id=about
        ),
    )


def parse_client_event(data: Any) -> Any:
    """One client event as the SDK's model, or ClientEventError."""
    event_id = data.get("event_id") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ClientEventError("A client event is a JSON object with a string 'type'.", "invalid_event", "type")
    kind = data["type"]
    if kind in APPEND_ONLY_EVENTS:
        raise ClientEventError(
            f"{kind} is not supported: this conversation is a streaming session, append-only; its "
            "items stay as they are.",
            "unsupported_on_session",
            "type",
            event_id,
        )
    if kind in AUDIO_EVENTS:
        raise ClientEventError(f"{kind}: this server is text only.", "audio_not_supported", "type", event_id)
    if kind not in SUPPORTED_EVENTS:
        raise ClientEventError(
            f"Unknown or unsupported event type {kind!r}; expected one of {', '.join(SUPPORTED_EVENTS)}.",
            "invalid_event_type",
            "type",
            event_id,
        )
    try:
        return CLIENT_EVENTS[kind].model_validate(data)
    except ValidationError as exc:
        first = most_specific(exc.errors())
        param = error_param(first.get("loc"))
        raise ClientEventError(
            f"{param}: {first.get('msg')}" if param else str(first.get("msg")), "invalid_event", param, event_id
        ) from None


def dump(event: BaseModel) -> str:
    return event.model_dump_json(exclude_none=True)
