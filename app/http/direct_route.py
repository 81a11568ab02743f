"""A hot POST route served straight from ASGI, for requests FastAPI would take as they are.

A chunk append is the request a client sends most often, and its own work is small: on a
2-core machine FastAPI's request machinery (routing, dependency solving, body validation,
its exception middleware) and vLLM's middlewares inside ours (CORS, scaling, its Prometheus
instrumentator) cost about as much server CPU per chunk as the session logic does
(docs/benchmarks.md §8). ``DirectRoute`` sits inside our own middlewares (keys, rate
limits, body size, a dead engine all still apply) and serves a request itself only when
FastAPI would have called the endpoint with the same arguments: a JSON body that validates
against the endpoint's model, no CORS ``Origin``, no ``root_path``. Anything else goes on to
the app unchanged, body replayed, so every refusal is FastAPI's own and the route, its
schema and its errors are defined once, by the FastAPI endpoint.

vLLM's HTTP instrumentator does not count the requests served here (our own chunk
counters do: ``streamsess_chunks_total``, by transport).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import APIError, internal_error
from app.http.body import read_body, replaying
from app.http.errors import error_response

logger = logging.getLogger(__name__)

# (scope, receive, the path's one parameter, the validated body) -> the answer
DirectHandler = Callable[[Scope, Receive, str, Any], Awaitable[Response]]


class DirectRoute:
    """``POST {prefix}{param}{suffix}`` with a ``model`` body, answered by ``handler``."""

    def __init__(
        self, app: ASGIApp, *, prefix: str, suffix: str, model: type[BaseModel], handler: DirectHandler
    ) -> None:
        self.app = app
        self.prefix = prefix
        self.suffix = suffix
        self.model = model
        self.handler = handler

    def _param(self, scope: Scope) -> str | None:
        """The path parameter, if this request is one this route may serve itself."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return None
        path: str = scope["path"]
        if not (path.startswith(self.prefix) and path.endswith(self.suffix)):
            return None
        param = path[len(self.prefix) : len(path) - len(self.suffix)]
        if not param or "/" in param:
            return None
        for name, value in scope["headers"]:
            # A CORS request (vLLM's CORS middleware answers it) or a body FastAPI would
            # not read as JSON: the app's own path.
            if name == b"origin" or (name == b"content-type" and not _is_json(value)):
                return None
        return param

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        param = self._param(scope)
        if param is None:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)  # its size is bounded by BodySizeLimitMiddleware, outside
        if body is None:
            return  # the client left before its body was read
        request = self._validated(body)
        if request is None:
            await self.app(scope, replaying(body, receive), send)
            return
        try:
            response = await self.handler(scope, receive, param, request)
        except APIError as error:
            response = error_response(error)
        except Exception:
            # As the app's handler for any exception: the OpenAI shape, no detail.
            logger.exception("%s %s failed", scope["method"], scope["path"])
            response = error_response(internal_error())
        await response(scope, receive, send)

    def _validated(self, body: bytes) -> Any:
        """The body as FastAPI would pass it to the endpoint (``json.loads`` then the
        model's validation in Python mode), or None where FastAPI would refuse it."""
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(payload, dict):
            return None
        try:
            return self.model.model_validate(payload)
        except ValidationError:
            return None


def _is_json(content_type: bytes) -> bool:
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))
