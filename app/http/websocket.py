"""One websocket's event channel: sends under one lock, and the read loop with its limits.

Both websocket protocols (the session events and the Realtime API) read and send
through this, so a frame limit, a rate limit or a disconnect is handled in one place.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import WebSocket, WebSocketDisconnect

from app.errors import APIError
from app.limits import KeyLimits

logger = logging.getLogger(__name__)

# uvicorn closes every websocket with 1012 (service restart) when the server stops:
# such a disconnect is the server going away, not the client.
SERVER_STOPPING = 1012


def refusal_close_code(error: APIError) -> int:
    """How a connection refused on accept is closed: 1012 (service restart: reconnect,
    another replica takes the session) for a draining server, 1008 (policy) for the
    client's error, 1011 for the server's."""
    if error.code == "server_draining":
        return SERVER_STOPPING
    return 1008 if error.status < 500 else 1011


class EventChannel:
    def __init__(self, websocket: WebSocket, limits: KeyLimits, owner: str,
                 refuse: Callable[[APIError], Awaitable[None]]) -> None:
        self.websocket = websocket
        self._limits = limits
        self._owner = owner
        self._refuse = refuse  # answers a frame that is not taken, as the protocol's error event
        self._send_lock = asyncio.Lock()
        self.connection_id = f"conn_{secrets.token_hex(8)}"
        # Whether the connection ended because the server is stopping.
        self.server_stopping = False

    async def send_text(self, text: str) -> None:
        async with self._send_lock:
            try:
                await self.websocket.send_text(text)
            except (WebSocketDisconnect, RuntimeError):
                # The client went away; the read loop sees the disconnect and ends.
                logger.debug("%s: connection closed, event dropped", self.connection_id)

    async def frames(self) -> AsyncIterator[str]:
        """Each text frame the key's event rate admits; others are refused (and the
        connection stays open). Ends when either side closes the connection."""
        while True:
            try:
                raw = await self.websocket.receive_text()
            except WebSocketDisconnect as exc:
                self.server_stopping = exc.code == SERVER_STOPPING
                return
            except RuntimeError:  # the socket was closed by our side
                return
            except KeyError:  # a binary frame
                await self._refuse(APIError(400, "Client events are JSON text frames.", code="invalid_event"))
                continue
            try:
                await self._limits.admit_event(self._owner, self.connection_id)
            except APIError as exc:
                await self._refuse(exc)
                continue
            yield raw
