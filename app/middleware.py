"""Small ASGI middlewares: request size limit, replica naming, a dead engine."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError, send_http_error


class BodySizeLimitMiddleware:
    """Refuse request bodies over the limit with 413 before reading them."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                error = APIError(
                    413, f"The request body exceeds {self.max_bytes} bytes.", code="request_too_large",
                    type="invalid_request_error",
                )
                await send_http_error(send, error)
                return
        await self.app(scope, receive, send)


class ReplicaHeaderMiddleware:
    """Name this replica on every HTTP response (X-Replica), so operators and tests
    behind a proxy can see which replica answered."""

    def __init__(self, app: ASGIApp, replica_name: str):
        self.app = app
        self._header = (b"x-replica", replica_name.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


# Routes that answer without the engine (health says it is dead; metrics, docs).
ENGINE_FREE_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/redoc", "/ping"})


def engine_dead_error() -> APIError:
    return APIError(503, "The engine has died; this server is restarting. Retry shortly: sessions are kept "
                    "in the store.", code="engine_dead", headers={"Retry-After": "5"})


class EngineDeadMiddleware:
    """Once the engine has died, every route that needs it answers 503 engine_dead
    (websockets: an error event, then close 1011) instead of failing on its own."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = getattr(scope["app"].state, "engine_client", None) if scope["type"] in ("http", "websocket") else None
        path = scope.get("path", "")
        if engine is None or not engine.errored or path in ENGINE_FREE_PATHS or path.startswith("/metrics/"):
            await self.app(scope, receive, send)
            return
        error = engine_dead_error()
        if scope["type"] == "http":
            await send_http_error(send, error, [(b"retry-after", b"5")])
            return
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        event = {"type": "error", "event_id": "event_engine_dead", "error": {**error.body()["error"], "event_id": None}}
        await send({"type": "websocket.send", "text": json.dumps(event)})
        await send({"type": "websocket.close", "code": 1011, "reason": "engine_dead"})
