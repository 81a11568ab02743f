"""Thin websocket route for the OpenAI Realtime API (GA, text): ``/v1/realtime``.

``?model=`` names the served model (extra query parameters are ignored). One
session per connection: a new one, closed with the connection, or, with our
extension ``?session_id=``, an existing session, which outlives it. Clients of the
beta protocol (``OpenAI-Beta: realtime=v1``) are refused with an error event.
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from app.api.deps import LimitsDep, OwnerDep, RealtimeDep, RouteKeyDep
from app.api.realtime.connection import RealtimeConnection
from app.api.realtime.protocol import dump, error_event
from app.errors import APIError
from app.http.websocket import refuse_connection
from app.protocol import SessionCreateRequest

router = APIRouter(tags=["realtime"])


@router.websocket("/v1/realtime")
async def realtime(
    websocket: WebSocket, realtime: RealtimeDep, limits: LimitsDep, owner: OwnerDep, route_key: RouteKeyDep
) -> None:
    await websocket.accept()
    service = realtime.sessions
    query = websocket.query_params
    try:
        if "realtime=v1" in websocket.headers.get("openai-beta", ""):
            raise APIError(
                400,
                "The Realtime beta protocol (OpenAI-Beta: realtime=v1) is not served; use the GA "
                "protocol (openai>=2: client.realtime.connect).",
                code="beta_protocol_unsupported",
            )
        service.check_model(query.get("model"))
        if (session_id := query.get("session_id")) is not None:
            session = await service.attach_connection(owner, session_id)
            owns_session = False
        else:
            session = await service.create(owner, SessionCreateRequest(), route_key=route_key)
            owns_session = True
    except APIError as exc:
        await refuse_connection(websocket, exc, dump(error_event(exc, "event_refused")))
        return
    await RealtimeConnection(websocket, realtime, limits, owner, session, owns_session).run()
