"""Cancel work when the HTTP client goes away, as the ASGI server reports it.

No polling: the request's body is read, so the next ``receive()`` returns only when the
client disconnects (uvicorn's ``http.disconnect``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol, TypeVar

from app.errors import APIError

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Cancellable(Protocol):
    def cancel(self) -> Any: ...


class CancellableWork(Cancellable, Protocol[T_co]):
    """Work that runs on its own and can be cancelled: a chunk's ``ChunkRun``."""

    def result(self) -> Awaitable[T_co]: ...


async def cancel_on_disconnect(receive: Callable[[], Awaitable[MutableMapping[str, Any]]], work: Cancellable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    work.cancel()


async def unless_disconnected(
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]], work: CancellableWork[T]
) -> T:
    """Await ``work``'s result here, cancelling the work if the client disconnects first,
    so an abandoned chunk aborts its engine request instead of running on. The result is
    awaited in this task: a listener is the only task this adds."""
    listener = asyncio.create_task(cancel_on_disconnect(receive, work))
    try:
        return await work.result()
    except (APIError, asyncio.CancelledError):
        if listener.done() and not listener.cancelled():
            raise APIError(499, "The client closed the connection.", code="client_disconnected") from None
        raise
    finally:
        listener.cancel()
