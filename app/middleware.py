"""Small ASGI middlewares: request size limit and replica naming."""

from __future__ import annotations

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
