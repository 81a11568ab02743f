"""The edge's small ASGI middlewares: request size limit, replica naming, Anthropic's
error shape, a dead engine, and per-key rate limits."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError
from app.http.auth import owner_of
from app.http.body import body_too_large, read_body, replaying
from app.http.errors import (
    ANTHROPIC_PATHS,
    anthropic_error_bytes,
    reshaping_errors,
    send_http_error,
    send_refusal,
)
from app.limits import UNLIMITED_PATHS, KeyLimits


class BodySizeLimitMiddleware:
    """Refuse request bodies over the limit with 413: by their ``Content-Length`` before
    reading them; a body sent in chunked encoding (no length) is read here, up to the
    limit, and handed on whole (every route reads its body whole anyway)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunked = False
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await send_http_error(send, body_too_large(self.max_bytes))
                return
            chunked = chunked or (name == b"transfer-encoding" and b"chunked" in value.lower())
        if not chunked:
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(receive, self.max_bytes)
        except APIError as error:
            await send_http_error(send, error)
            return
        if body is not None:
            await self.app(scope, replaying(body, receive), send)


class ReplicaHeaderMiddleware:
    """Name this replica on every HTTP response and websocket handshake (X-Replica), so
    operators and tests behind a proxy can see which replica answered."""

    def __init__(self, app: ASGIApp, replica_name: str):
        self.app = app
        self._header = (b"x-replica", replica_name.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*message.get("headers", ()), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


# Routes that answer without the engine (health says it is dead; metrics, docs).
ENGINE_FREE_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json", "/docs", "/redoc", "/ping"})


def engine_dead_error() -> APIError:
    return APIError(
        503,
        "The engine has died; this server is restarting. Retry shortly: sessions are kept in the store.",
        code="engine_dead",
        headers={"Retry-After": "5"},
    )


class AnthropicErrorMiddleware:
    """On Anthropic's routes every error takes Anthropic's shape, whoever refused the
    request (a key, a rate limit, the strict validation, vLLM's handler): Anthropic's
    SDK reads that one."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") in ANTHROPIC_PATHS:
            send = reshaping_errors(send, anthropic_error_bytes)
        await self.app(scope, receive, send)


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
        await send_refusal(scope, receive, send, engine_dead_error(), ws_close_code=1011)


class RateLimitMiddleware:
    """Every HTTP request and websocket connection counts against its key's
    requests per minute; websocket connections against its open-connection limit.
    Runs inside the API-key middleware, which names the key."""

    def __init__(self, app: ASGIApp, limits: KeyLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in UNLIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        owner = owner_of(scope)
        close_code = 1008  # policy violation
        try:
            await self.limits.admit_request(owner)
            if scope["type"] == "http":
                await self.app(scope, receive, send)
                return
            with self.limits.connection(owner):
                await self.app(scope, receive, send)
        except APIError as error:
            await send_refusal(scope, receive, send, error, ws_close_code=close_code)
