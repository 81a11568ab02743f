"""Cancel a task when the HTTP client goes away, as the ASGI server reports it.

No polling: the request's body is read, so the next ``receive()`` returns only when the
client disconnects (uvicorn's ``http.disconnect``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from starlette.requests import Request

from app.errors import APIError

T = TypeVar("T")


async def cancel_on_disconnect(
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]], task: asyncio.Future[Any]
) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first, so an abandoned
    chunk aborts its engine request instead of running on."""
    task = asyncio.ensure_future(work)
    listener = asyncio.create_task(cancel_on_disconnect(request.receive, task))
    try:
        return await task
    except asyncio.CancelledError:
        if listener.done() and not listener.cancelled():
            raise APIError(499, "The client closed the connection.", code="client_disconnected") from None
        raise
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
