"""Small ASGI middlewares: request size limit, replica naming, a dead engine, and
the strict validation, cache salt and token count of vLLM's OpenAI requests."""

from __future__ import annotations

import json
from collections.abc import Mapping

from fastapi.exceptions import RequestValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from vllm.entrypoints.generate.base.protocol import validate_cache_salt
from vllm.exceptions import VLLMValidationError

from app.cache_salt import CacheSalter
from app.errors import APIError
from app.http.auth import ANONYMOUS
from app.http.body import body_too_large, read_body, replaying
from app.http.errors import (
    ANTHROPIC_PATHS,
    anthropic_error_bytes,
    openai_error_bytes,
    reshaping_errors,
    send_http_error,
    send_refusal,
    validation_error,
)
from app.limits import UNLIMITED_PATHS, KeyLimits, estimated_tokens
from app.vllm_routes.routes import STATEFUL_FIELDS, OpenAIBodyRoute, strict_errors
from app.vllm_routes.sampling import check_sampling


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
    return APIError(503, "The engine has died; this server is restarting. Retry shortly: sessions are kept "
                    "in the store.", code="engine_dead", headers={"Retry-After": "5"})


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


class OpenAIRequestMiddleware:
    """Read the body of each of vLLM's POST routes in ``routes`` once, before vLLM does:

    - validate it in pydantic's strict mode where the route says so (no ``"1"`` for
      ``1``, as OpenAI's API answers), so the published schema is what the server
      enforces: 400 in the OpenAI shape otherwise;
    - on routes that generate, give it the caller's cache salt, in place of (and
      derived from) any the client sent (``salter``), and charge its estimated tokens
      to the caller's key (``limits``).

    A validator of vLLM's own that refuses the body (``VLLMValidationError``) gets the
    same 400, before any salting could mend the body; an error vLLM's handler answers
    takes OpenAI's shape too (``openai_error_bytes``). Bodies that are not a JSON object
    pass through untouched, for vLLM to refuse, as do bodies whose validation raises
    anything else (vLLM raises it again and answers it itself)."""

    def __init__(
        self, app: ASGIApp, routes: Mapping[str, OpenAIBodyRoute], salter: CacheSalter | None,
        limits: KeyLimits | None, default_max_tokens: int,
    ):
        self.app = app
        self.routes = routes
        self.salter = salter
        self.limits = limits
        self.default_max_tokens = default_max_tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope.get("path", "")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)  # bounded by BodySizeLimitMiddleware, outside
        if body is None:
            return
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):  # not JSON (nor UTF-8), or nested too deep: vLLM refuses it
            payload = None
        if isinstance(payload, dict):
            if not route.stateful and (field := next((f for f in STATEFUL_FIELDS if f in payload), None)):
                await send_http_error(send, APIError(
                    400, f"{field} is honoured on /v1/responses only; this route keeps no state.",
                    code="unsupported_parameter", param=field))
                return
            if route.strict_validator is not None:
                try:
                    # vLLM's rule for salts, which some of its routes (chat batches) skip.
                    validate_cache_salt(payload.get("cache_salt"))
                    service = getattr(scope["app"].state, "session_service", None) if "app" in scope else None
                    check_sampling(payload, getattr(service, "max_model_len", None))
                    if errors := strict_errors(route.strict_validator, body, payload):
                        # Located in the body, as FastAPI's own are (a field named
                        # "query" is not the query string).
                        located = [{**error, "loc": ("body", *error.get("loc", ()))} for error in errors]
                        await send_http_error(send, validation_error(RequestValidationError(located)))
                        return
                except VLLMValidationError as invalid:  # raised by one of vLLM's own validators
                    reason = str(invalid.args[0]) if invalid.args else "Invalid request."
                    error = APIError(400, reason, code="invalid_request", param=invalid.parameter)
                    await send_http_error(send, error)
                    return
                except (AttributeError, TypeError, KeyError, IndexError) as crash:
                    # One of vLLM's before-validators read a field of the wrong shape
                    # (``structured_outputs: []``): FastAPI's own validation would hit
                    # the same and answer 500. The body is what is wrong.
                    await send_http_error(send, APIError(400, f"Invalid request body: {crash}", code="invalid_request"))
                    return
                except Exception:  # any other: vLLM raises it again and answers it its own way
                    pass
            owner = owner_of(scope)
            if route.generates and self.limits is not None:
                try:
                    await self.limits.charge_tokens(owner, estimated_tokens(payload, self.default_max_tokens))
                except APIError as error:
                    await send_http_error(send, error)
                    return
            if route.generates and self.salter is not None:
                client_salt = payload.get("cache_salt")
                payload["cache_salt"] = self.salter.salt(owner, client_salt if isinstance(client_salt, str) else None)
                body = json.dumps(payload).encode()
        headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": headers}, replaying(body, receive), reshaping_errors(send, openai_error_bytes))


def owner_of(scope: Scope) -> str:
    """The caller, as the API-key middleware named it in the scope."""
    return str(scope.get("state", {}).get("owner", ANONYMOUS))


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
