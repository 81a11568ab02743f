"""Thin websocket transport: accept, find or create the session, hand over."""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from app.api.deps import LimitsDep, OwnerDep, RouteKeyDep, ServiceDep
from app.api.sessions.connection import SessionConnection, error_event
from app.errors import APIError
from app.http.websocket import refuse_connection
from app.protocol import SessionCreateRequest

router = APIRouter(tags=["sessions"])


@router.websocket("/v1/sessions/ws")
async def new_session_ws(
    websocket: WebSocket, service: ServiceDep, limits: LimitsDep, owner: OwnerDep, route_key: RouteKeyDep
) -> None:
    """Open a new session for this connection; it closes when the connection does."""
    await websocket.accept()
    try:
        session = await service.create(
            owner, SessionCreateRequest(), session_id=websocket.headers.get("x-session-id"), route_key=route_key
        )
    except APIError as exc:
        await _refuse(websocket, exc)
        return
    await SessionConnection(websocket, service, limits, owner, session, owns_session=True).run()


@router.websocket("/v1/sessions/{session_id}/ws")
async def attach_session_ws(
    websocket: WebSocket, session_id: str, service: ServiceDep, limits: LimitsDep, owner: OwnerDep
) -> None:
    """Attach to an existing session; it stays open when the connection ends."""
    await websocket.accept()
    try:
        session = await service.attach_connection(owner, session_id)
    except APIError as exc:
        await _refuse(websocket, exc)
        return
    await SessionConnection(websocket, service, limits, owner, session, owns_session=False).run()


async def _refuse(websocket: WebSocket, error: APIError) -> None:
    await refuse_connection(websocket, error, error_event(error, "event_refused").model_dump_json())
