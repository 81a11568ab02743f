"""Cancel a task when the HTTP client goes away, as the ASGI server reports it.

No polling: the request's body is read, so the next ``receive()`` returns only when the
client disconnects (uvicorn's ``http.disconnect``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any


async def cancel_on_disconnect(
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]], task: asyncio.Future[Any]
) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()
