"""Typed FastAPI dependencies: the service, the caller, the engine.

All ``async def``: FastAPI runs a plain ``def`` dependency in its thread pool, one
thread hop per dependency per request (they cost more than a REST chunk's own work
on a busy 2-core machine; benchmarks/transport.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends
from starlette.requests import HTTPConnection

from app.api.conversations.serving import ConversationsService
from app.api.realtime.serving import RealtimeService
from app.api.responses.serving import ResponsesService
from app.http.auth import owner_of
from app.limits import KeyLimits
from app.routing import ROUTE_KEY_HEADER, valid_key
from app.sessions.service import SessionService


async def get_session_service(connection: HTTPConnection) -> SessionService:
    return connection.app.state.session_service


async def get_responses_service(connection: HTTPConnection) -> ResponsesService:
    return connection.app.state.responses_service


async def get_conversations_service(connection: HTTPConnection) -> ConversationsService:
    return connection.app.state.conversations_service


async def get_realtime_service(connection: HTTPConnection) -> RealtimeService:
    return connection.app.state.realtime_service


async def get_limits(connection: HTTPConnection) -> KeyLimits:
    """The per-key limits the edge enforces (a websocket counts each event against them)."""
    return connection.app.state.limits


async def get_owner(connection: HTTPConnection) -> str:
    """The caller, as set by the API-key middleware."""
    return owner_of(connection.scope)


async def get_route_key(connection: HTTPConnection) -> str | None:
    """The key a session-affine proxy routed this request by, for the ids of the
    conversation it may open (``app.routing``); None without one."""
    return valid_key(connection.headers.get(ROUTE_KEY_HEADER))


async def get_engine(connection: HTTPConnection) -> Any:
    return connection.app.state.engine_client


ServiceDep = Annotated[SessionService, Depends(get_session_service)]
ResponsesDep = Annotated[ResponsesService, Depends(get_responses_service)]
ConversationsDep = Annotated[ConversationsService, Depends(get_conversations_service)]
RealtimeDep = Annotated[RealtimeService, Depends(get_realtime_service)]
LimitsDep = Annotated[KeyLimits, Depends(get_limits)]
OwnerDep = Annotated[str, Depends(get_owner)]
EngineDep = Annotated[Any, Depends(get_engine)]
RouteKeyDep = Annotated[str | None, Depends(get_route_key)]
