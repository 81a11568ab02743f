"""A conversation is a session whose id is the conversation's, its metadata the
session's; its items are kept in the store beside it, in order. Added items reach the
model with the conversation's next response (``ResponsesService``), which appends only
what the session does not render yet, and re-renders from the common prefix where an
item was deleted. No FastAPI here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app import routing
from app.api.responses import items
from app.api.responses.serving import ResponsesService
from app.errors import APIError
from app.protocol import SessionCreateRequest
from app.sessions.session import StreamingSession


class ConversationsService:
    def __init__(self, responses: ResponsesService) -> None:
        self.responses = responses
        self.sessions = responses.sessions

    async def create(
        self, owner: str, raw_items: Sequence[Any] | None, metadata: dict[str, str] | None, route_key: str | None = None
    ) -> dict[str, Any]:
        new = items.input_items(raw_items or [], param="items")
        session = await self.sessions.create(
            owner, SessionCreateRequest(metadata=metadata or {}), session_id=routing.mint("conv", route_key)
        )
        await self.responses.add_items(owner, session.id, new)
        return _conversation(session)

    async def _session(self, owner: str, conversation_id: str) -> StreamingSession:
        return await self.responses.conversation(owner, conversation_id)

    async def retrieve(self, owner: str, conversation_id: str) -> dict[str, Any]:
        return _conversation(await self._session(owner, conversation_id))

    async def update(self, owner: str, conversation_id: str, metadata: dict[str, str]) -> dict[str, Any]:
        await self._session(owner, conversation_id)
        return _conversation(await self.sessions.update_metadata(owner, conversation_id, metadata))

    async def delete(self, owner: str, conversation_id: str) -> dict[str, Any]:
        await self._session(owner, conversation_id)
        await self.sessions.close(owner, conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    async def add_items(self, owner: str, conversation_id: str, raw_items: Sequence[Any]) -> list[dict[str, Any]]:
        await self._session(owner, conversation_id)
        return await self.responses.add_items(owner, conversation_id, items.input_items(raw_items, param="items"))

    async def list_items(self, owner: str, conversation_id: str) -> list[dict[str, Any]]:
        return [obj.data for obj in await self.responses.conversation_items(owner, conversation_id)]

    async def retrieve_item(self, owner: str, conversation_id: str, item_id: str) -> dict[str, Any]:
        for item in await self.list_items(owner, conversation_id):
            if item["id"] == item_id:
                return item
        raise _item_not_found(item_id)

    async def delete_item(self, owner: str, conversation_id: str, item_id: str) -> dict[str, Any]:
        """The item leaves the log; the next response renders the conversation without
        it, recomputing from where it was (the session keeps the prefix before it)."""
        await self.retrieve_item(owner, conversation_id, item_id)
        await self.responses.delete_item(item_id)
        return await self.retrieve(owner, conversation_id)


def _conversation(session: StreamingSession) -> dict[str, Any]:
    return {
        "id": session.id,
        "object": "conversation",
        "created_at": int(session.created),
        "metadata": dict(session.metadata),
    }


def _item_not_found(item_id: str) -> APIError:
    return APIError(404, f"No item with id {item_id!r} in this conversation.", code="item_not_found", param="item_id")
