"""Thin routes of OpenAI's Conversations API (``/v1/conversations``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from app.api.deps import ConversationsDep, OwnerDep, RouteKeyDep
from app.api.responses.api_router import ERRORS, page
from app.api.responses.protocol import (
    ConversationCreateRequest,
    ConversationItemsCreateRequest,
    ConversationUpdateRequest,
)

router = APIRouter(prefix="/v1/conversations", tags=["conversations"])


@router.post("", responses=ERRORS)
async def create_conversation(
    service: ConversationsDep, owner: OwnerDep, route_key: RouteKeyDep, body: ConversationCreateRequest | None = None
) -> JSONResponse:
    body = body or ConversationCreateRequest()
    return JSONResponse(await service.create(owner, body.items, body.metadata, route_key))


@router.get("/{conversation_id}", responses=ERRORS)
async def retrieve_conversation(conversation_id: str, service: ConversationsDep, owner: OwnerDep) -> JSONResponse:
    return JSONResponse(await service.retrieve(owner, conversation_id))


@router.post("/{conversation_id}", responses=ERRORS)
async def update_conversation(
    conversation_id: str, body: ConversationUpdateRequest, service: ConversationsDep, owner: OwnerDep
) -> JSONResponse:
    return JSONResponse(await service.update(owner, conversation_id, body.metadata))


@router.delete("/{conversation_id}", responses=ERRORS)
async def delete_conversation(conversation_id: str, service: ConversationsDep, owner: OwnerDep) -> JSONResponse:
    return JSONResponse(await service.delete(owner, conversation_id))


@router.post("/{conversation_id}/items", responses=ERRORS)
async def create_items(
    conversation_id: str, body: ConversationItemsCreateRequest, service: ConversationsDep, owner: OwnerDep
) -> JSONResponse:
    added = await service.add_items(owner, conversation_id, body.items)
    return JSONResponse(page(added, None, len(added), "asc"))


@router.get("/{conversation_id}/items", responses=ERRORS)
async def list_items(
    conversation_id: str,
    service: ConversationsDep,
    owner: OwnerDep,
    after: Annotated[str | None, Query(min_length=1)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    include: Annotated[list[str] | None, Query()] = None,
) -> JSONResponse:
    return JSONResponse(page(await service.list_items(owner, conversation_id), after, limit, order))


@router.get("/{conversation_id}/items/{item_id}", responses=ERRORS)
async def retrieve_item(
    conversation_id: str,
    item_id: str,
    service: ConversationsDep,
    owner: OwnerDep,
    include: Annotated[list[str] | None, Query()] = None,
) -> Any:
    return JSONResponse(await service.retrieve_item(owner, conversation_id, item_id))


@router.delete("/{conversation_id}/items/{item_id}", responses=ERRORS)
async def delete_item(conversation_id: str, item_id: str, service: ConversationsDep, owner: OwnerDep) -> JSONResponse:
    return JSONResponse(await service.delete_item(owner, conversation_id, item_id))
