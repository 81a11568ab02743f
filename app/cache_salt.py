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
import secrets
from pathlib import Path

from app.settings import Settings

SECRET_FILE = "cache_salt_secret"


class CacheSalter:
    def __init__(self, secret: bytes):
        # Replaced once at start by the cluster's, where replicas share a store (app/store/cluster.py).
        self.secret = secret

    def salt(self, owner: str, client_salt: str | None = None) -> str:
        message = owner.encode() + b"\0" + (client_salt or "").encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()[:32]


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
