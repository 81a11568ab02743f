"""Routing keys (app/routing.py) and the proxy's copy of their rule
(docker/haproxy/haproxy.cfg): the proxy must find in an id the key the server put
there, or a conversation's turns scatter over replicas."""

from __future__ import annotations

import re
from pathlib import Path

from app import routing

HAPROXY_CFG = Path(__file__).resolve().parents[2] / "docker" / "haproxy" / "haproxy.cfg"


def proxy_key(object_id: str) -> str:
    """What the proxy hashes for an id: its regsub rule, applied as HAProxy does
    (substitute the first match; an id that does not match stays whole)."""
    rule = next(line for line in HAPROXY_CFG.read_text().splitlines() if "set-var(txn.key) var(txn.conv)" in line)
    pattern, replacement = re.search(r'regsub\(\\"(.*?)\\",\\"(.*?)\\"\)', rule).groups()  # type: ignore[union-attr]
    return re.sub(pattern, replacement.replace("\\1", r"\1"), object_id, count=1)


def test_every_minted_id_carries_its_key_and_the_proxy_finds_it() -> None:
    key = "0123456789abcdef"
    for prefix in ("sess", "conv", "resp"):
        minted = routing.mint(prefix, key)
        assert minted.startswith(f"{prefix}_{key}") and len(minted) > len(prefix) + 1 + len(key)
        assert routing.key_of(minted) == key == proxy_key(minted)
    # Without a key (no proxy), a random one; two ids of one conversation share it.
    chain = routing.mint("resp")
    assert routing.key_of(routing.mint("resp", routing.key_of(chain))) == routing.key_of(chain) == proxy_key(chain)


def test_session_ids_keep_their_shape() -> None:
    """24 hex digits after sess_, as before keys: clients that parse them see no change."""
    assert re.fullmatch(r"sess_[0-9a-f]{24}", routing.mint("sess"))


def test_ids_of_other_shapes_are_routed_whole() -> None:
    for object_id in ("my-session", "client_chosen", "sess_ABCDEF0123456789", "resp_0123"):
        assert routing.key_of(object_id) is None
        assert proxy_key(object_id) == object_id


def test_a_key_from_a_header_is_taken_only_if_it_is_one() -> None:
    assert routing.valid_key("0123456789abcdef") == "0123456789abcdef"
    for bad in (None, "", "0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0", "my-session"):
        assert routing.valid_key(bad) is None
        assert routing.key_of(routing.mint("resp", bad)) != bad
