"""Per-key cache isolation: every request's prefix cache and CPU tier namespace.

vLLM mixes a request's ``cache_salt`` into its first block's hash, so requests with
different salts never share cached KV, on the device or in the CPU tier (whose
keys are those block hashes). Without salts, one API key could tell from another
key's ``usage`` (exactly) or timing (roughly) whether a prompt was sent before.

Each request therefore gets a salt derived from its key's identity with a server
secret: ``HMAC(secret, owner, client_salt)``. A client's own ``cache_salt`` (vLLM's
request field) splits its key's namespace further but cannot reach another key's.
``cache_isolation=shared`` turns this off, on purpose (e.g. a common system
prompt shared by every key): then only client salts separate requests.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError, send_http_error
from app.settings import Settings

# vLLM's OpenAI routes whose bodies take a cache_salt.
SALTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
SECRET_FILE = "cache_salt_secret"


class CacheSalter:
    def __init__(self, secret: bytes):
        self._secret = secret

    def salt(self, owner: str, client_salt: str | None = None) -> str:
        message = owner.encode() + b"\0" + (client_salt or "").encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:32]


def load_secret(configured: str | None, state_dir: str) -> bytes:
    """The configured secret, or one made once and kept in the state directory, so
    salts (and so cache hits) stay the same across restarts. Replicas that should
    share cache namespaces set the same ``cache_salt_secret``."""
    if configured:
        return configured.encode()
    path = Path(state_dir) / SECRET_FILE
    if path.exists():
        return path.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_hex(32).encode()
    path.touch(mode=0o600)
    path.write_bytes(secret)
    return secret


def cache_salter(settings: Settings) -> CacheSalter | None:
    """Per-key salts where there are keys to tell apart (with none, every caller is
    the same anonymous owner); None when the settings share the cache."""
    if not settings.api_keys or settings.cache_isolation == "shared":
        return None
    secret = settings.cache_salt_secret.get_secret_value() if settings.cache_salt_secret else None
    return CacheSalter(load_secret(secret, settings.resolved_state_dir()))


class CacheSaltMiddleware:
    """Give every ``/v1/completions`` and ``/v1/chat/completions`` body the caller's
    cache salt, in place of (and derived from) any the client sent; vLLM's own
    endpoints stay unchanged. Bodies that are not a JSON object pass through
    untouched, for vLLM to refuse."""

    def __init__(self, app: ASGIApp, salter: CacheSalter, max_bytes: int):
        self.app = app
        self.salter = salter
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in SALTED_PATHS:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                error = APIError(413, f"The request body exceeds {self.max_bytes} bytes.",
                                 code="request_too_large", type="invalid_request_error")
                await send_http_error(send, error)
                return
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        owner = str(scope.get("state", {}).get("owner", "anonymous"))
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            payload = None
        if isinstance(payload, dict):
            client_salt = payload.get("cache_salt")
            payload["cache_salt"] = self.salter.salt(owner, client_salt if isinstance(client_salt, str) else None)
            body = json.dumps(payload).encode()
        headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app({**scope, "headers": headers}, replay, send)
