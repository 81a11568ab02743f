"""Optional API keys: ``Authorization: Bearer <key>``, compared in constant time.

A pure ASGI middleware, so it guards websockets exactly like HTTP routes. It puts
the caller's identity (a fingerprint of the key, never the key) in
``scope["state"]["owner"]``: a session belongs to the key that created it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import unauthorized
from app.http.errors import send_refusal

ANONYMOUS = "anonymous"
ALWAYS_OPEN_PATHS = frozenset({"/health", "/ready"})


def key_owner(key: str) -> str:
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            text = value.decode("latin-1")
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: Iterable[str], guard_metrics: bool = False):
        self.app = app
        self._keys = [key.encode() for key in keys]
        # Each key's owner, hashed once here instead of on every request.
        self._owners = {key: key_owner(key.decode()) for key in self._keys}
        self._open_paths = set(ALWAYS_OPEN_PATHS) | (set() if guard_metrics else {"/metrics"})

    def _match(self, token: str | None) -> str | None:
        """The owner of the key ``token`` is, or None."""
        if token is None:
            return None
        candidate = token.encode()
        # Compare against every key, without stopping early, in constant time.
        matched = None
        for key in self._keys:
            if hmac.compare_digest(candidate, key):
                matched = self._owners[key]
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        path = scope.get("path", "")
        if not self._keys:
            state["owner"] = ANONYMOUS
            await self.app(scope, receive, send)
            return
        owner = self._match(bearer_token(scope))
        if owner is not None:
            state["owner"] = owner
            await self.app(scope, receive, send)
            return
        if path in self._open_paths or path.startswith("/metrics/"):
            state["owner"] = ANONYMOUS
            await self.app(scope, receive, send)
            return
        await send_refusal(
            scope, receive, send, unauthorized(), ws_close_code=1008, extra_headers=[(b"www-authenticate", b"Bearer")]
        )


def owner_of(scope: Scope) -> str:
    """The caller, as the API-key middleware named it in the scope."""
    return str(scope.get("state", {}).get("owner", ANONYMOUS))
