"""Routing keys: every id of a conversation carries the key that routes it.

A session's KV is on the replica that served it last, so every request that continues
a conversation should reach that replica. A stateless proxy can do that only if every
id a client sends back names the conversation: a session id, a conversation id, and
*each* response id of a ``previous_response_id`` chain (a chain is one session, but
each turn has an id of its own). So every id minted here for a conversation's objects
starts with the conversation's routing key, 16 hex digits after the prefix:
``sess_<key><random>``, ``conv_<key><random>``, ``resp_<key><random>``. The proxy
(``docker/haproxy/haproxy.cfg``) takes the key out of whichever id the request names
(path, query string, JSON body, a session header) with the same pattern as
``key_of``, and hashes it; ids of any other shape (a client's own session id) are
hashed whole.

A new conversation has no id to hash yet: the proxy makes a key up, routes the
request by it and passes it in ``X-Streamsess-Route-Key``; the replica mints the new
ids with that key, so the next request lands where this one did. Without a proxy the
key is random. A key only steers routing: it grants nothing, and a client that sets
its own only chooses its conversation's replica.
"""

from __future__ import annotations

import re
import secrets

ROUTE_KEY_HEADER = "x-streamsess-route-key"
KEY_HEX_DIGITS = 16
_KEY = re.compile(f"[0-9a-f]{{{KEY_HEX_DIGITS}}}")
# The proxy's pattern: lowercase letters, "_", then the key (anything may follow).
_ID_WITH_KEY = re.compile(f"[a-z]+_([0-9a-f]{{{KEY_HEX_DIGITS}}})")
# Random hex digits after the key: with the key's 64 bits, as unguessable as before.
_RANDOM_HEX_DIGITS = {"sess": 8, "conv": 16, "resp": 16}


def key_of(object_id: str | None) -> str | None:
    """The routing key an id carries, or None (an id of another shape)."""
    if object_id is None or (match := _ID_WITH_KEY.match(object_id)) is None:
        return None
    return match.group(1)


def valid_key(key: str | None) -> str | None:
    """A key passed in by the proxy (or a client), if it is one; None otherwise."""
    return key if key is not None and _KEY.fullmatch(key) else None


def mint(prefix: str, key: str | None = None) -> str:
    """A new id under ``key`` (a new random key when there is none)."""
    key = valid_key(key) or secrets.token_hex(KEY_HEX_DIGITS // 2)
    return f"{prefix}_{key}{secrets.token_hex(_RANDOM_HEX_DIGITS.get(prefix, 16) // 2)}"
