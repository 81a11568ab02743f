"""Per-key rate and size limits: requests and tokens per minute, websocket
connections and events.

Windows are moving windows from the ``limits`` library (the one behind slowapi and
Flask-Limiter), in this process's memory by default; replicas that should share
one budget per key point ``rate_limit_storage_url`` at a shared store (e.g.
``async+redis://host:6379``). Open websocket connections are counted per replica.

Tokens are counted when a request is admitted, as OpenAI counts them: its input
tokens plus its ``max_tokens``. For a session chunk that is the chunk's own new
tokens: the transcript before it is not computed again, so it is not charged again.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from limits import RateLimitItem, RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.aio.storage import Storage
from limits.aio.strategies import MovingWindowRateLimiter
from limits.storage import storage_from_string

from app.errors import APIError
from app.settings import Settings

# Probes and scrapes are never limited.
UNLIMITED_PATHS = frozenset({"/health", "/ready", "/metrics", "/ping"})


def rate_limited(what: str, kind: str, limit: int, retry_after_s: float) -> APIError:
    retry = max(1, math.ceil(retry_after_s))
    return APIError(
        429,
        f"Rate limit reached for this API key: {what}, limit {limit}. Retry in {retry} s.",
        code="rate_limit_exceeded",
        type=kind,
        headers={"Retry-After": str(retry)},
    )


class KeyLimits:
    """The limits of every key (its owner id, see ``app.http.auth``). Free of FastAPI:
    the middleware, the session service and the websocket connections all ask it."""

    def __init__(self, settings: Settings):
        storage = storage_from_string(settings.rate_limit_storage_url)
        if not isinstance(storage, Storage):
            raise ValueError(
                f"rate_limit_storage_url must name an async storage (async+...): {settings.rate_limit_storage_url}"
            )
        self._limiter = MovingWindowRateLimiter(storage)
        rpm, tpm = settings.rate_limit_requests_per_minute, settings.rate_limit_tokens_per_minute
        self._requests = RateLimitItemPerMinute(rpm) if rpm else None
        self._tokens = RateLimitItemPerMinute(tpm) if tpm else None
        self._events = RateLimitItemPerSecond(settings.ws_events_per_second) if settings.ws_events_per_second else None
        self.max_connections = settings.ws_max_connections_per_key
        self._connections: Counter[str] = Counter()

    @property
    def counts_tokens(self) -> bool:
        return self._tokens is not None

    async def _hit(self, item: RateLimitItem | None, cost: int, *identifiers: str) -> float | None:
        """Take ``cost`` from the window; None if it fit, else seconds until it may."""
        if item is None or await self._limiter.hit(item, *identifiers, cost=cost):
            return None
        stats = await self._limiter.get_window_stats(item, *identifiers)
        return stats.reset_time - time.time()

    async def admit_request(self, owner: str) -> None:
        retry = await self._hit(self._requests, 1, "requests", owner)
        if retry is not None:
            assert self._requests is not None
            raise rate_limited("requests per minute", "requests", self._requests.amount, retry)

    async def charge_tokens(self, owner: str, tokens: int) -> None:
        if self._tokens is None:
            return
        if tokens > self._tokens.amount:
            raise APIError(
                429,
                f"This request counts {tokens} tokens (input plus max_tokens), more than this API key's "
                f"limit of {self._tokens.amount} tokens per minute; lower max_tokens or send less input.",
                code="rate_limit_exceeded",
                type="tokens",
            )
        retry = await self._hit(self._tokens, tokens, "tokens", owner)
        if retry is not None:
            raise rate_limited("tokens per minute", "tokens", self._tokens.amount, retry)

    async def admit_event(self, owner: str, connection: str) -> None:
        """One client event on a websocket (per connection: a flood on one does
        not starve the key's others)."""
        retry = await self._hit(self._events, 1, "events", owner, connection)
        if retry is not None:
            assert self._events is not None
            raise rate_limited("websocket events per second", "requests", self._events.amount, retry)

    @contextlib.contextmanager
    def connection(self, owner: str) -> Iterator[None]:
        """Count an open websocket connection of ``owner`` while it lasts."""
        if self.max_connections and self._connections[owner] >= self.max_connections:
            raise APIError(
                429,
                f"This API key has {self.max_connections} websocket connections open here, its limit.",
                code="too_many_connections",
                type="requests",
            )
        self._connections[owner] += 1
        try:
            yield
        finally:
            self._connections[owner] -= 1
            if not self._connections[owner]:
                del self._connections[owner]


def estimated_tokens(payload: dict[str, Any], default_max_tokens: int) -> int:
    """A generation request's tokens for rate limiting, before tokenizing it: token-id
    prompts exactly, text at 4 bytes a token (OpenAI's own rule of thumb), plus
    max_tokens (or the server's per-request default when it is absent)."""

    def text_tokens(value: Any) -> int:
        if isinstance(value, str):
            return math.ceil(len(value.encode()) / 4)
        if isinstance(value, list):
            if value and all(isinstance(item, int) for item in value):
                return len(value)
            return sum(text_tokens(item) for item in value)
        if isinstance(value, dict):  # a chat message or content part
            return sum(text_tokens(value.get(field)) for field in ("content", "text"))
        return 0

    # Completions' prompt, chat's and Anthropic's messages and system, Responses' input
    # and instructions.
    prompt = sum(text_tokens(payload.get(field)) for field in ("prompt", "messages", "system", "input", "instructions"))
    max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens") or payload.get("max_output_tokens")
    return prompt + (max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else default_max_tokens)
