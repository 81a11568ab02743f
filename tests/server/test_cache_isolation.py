"""Per-key cache isolation: one API key cannot see another key's prompts through the
prefix cache or the CPU tier.

The probe that found the leak: key A runs a session on a 256-token prompt and
closes it; key B sends the same prompt to /v1/completions. Oracle: the usage's
provenance, which is the scheduler's own count of cached tokens (device and CPU
tier). B must see 0 of A's tokens, over REST sessions, /v1/completions, the
websocket and Realtime, and over every other vLLM route that reports cached tokens
(Responses, Anthropic Messages, SageMaker's /invocations), where the oracle is that
route's own usage field (chat completions, Responses, Anthropic Messages, SageMaker's
/invocations; Realtime's ``response.done``); A itself still hits (the positive
control); with ``cache_isolation=shared`` B hits again on the same paths, the CPU
tier's included (the negative control). Timing is not
asserted here (tests never assert wall-clock times); a cold prefill is what 0
cached tokens means; the timing probe is a benchmark, benchmarks/isolation.py.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
import websockets

from tests.conftest import API_KEYS, auth, make_settings
from tests.helpers import park_idle_sessions_of_running_apps, running_app

pytestmark = pytest.mark.server

ALICE, BOB = (auth(key) for key in API_KEYS)


def prompt(seed: int) -> list[int]:
    # A stream of its own: other tests seed Random with small integers too, and a
    # prompt they sent under the same key would be a legitimate cache hit here.
    rng = random.Random(f"cache-isolation-{seed}")
    return [rng.randrange(1, 700) for _ in range(256)]


async def session_on(http: httpx.AsyncClient, tokens: list[int], headers: dict[str, str]) -> dict[str, Any]:
    created = await http.post("/v1/sessions", json={"defaults": {"temperature": 0}}, headers=headers)
    session_id = created.json()["id"]
    reply = await http.post(
        f"/v1/sessions/{session_id}/chunks", json={"input": tokens, "max_tokens": 1}, headers=headers
    )
    assert reply.status_code == 200, reply.text
    await http.delete(f"/v1/sessions/{session_id}", headers=headers)
    return dict(reply.json()["usage"]["prompt_tokens_details"])


async def completion_on(
    http: httpx.AsyncClient, tokens: list[int], headers: dict[str, str], **extra: Any
) -> dict[str, Any]:
    reply = await http.post(
        "/v1/completions",
        headers=headers,
        json={"model": "embedded-tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0, **extra},
    )
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["usage"]["prompt_tokens_details"])


async def websocket_chunk(server: str, tokens: list[int], headers: dict[str, str]) -> dict[str, Any]:
    url = server.replace("http://", "ws://") + "/v1/sessions/ws"
    async with websockets.connect(url, additional_headers=headers) as ws:
        await ws.recv()  # session.created
        await ws.send(json.dumps({"type": "input.append", "input": tokens, "max_tokens": 1}))
        while (event := json.loads(await ws.recv()))["type"] != "response.done":
            pass
    return dict(event["usage"]["prompt_tokens_details"])


def text_prompt(seed: int) -> str:
    rng = random.Random(f"cache-isolation-text-{seed}")
    return " ".join(rng.choice(("amber", "basalt", "cobalt", "dune", "ember", "fjord")) for _ in range(200))


# vLLM's other generating routes: a body for a text prompt, and where the route's usage
# says how many of its prompt tokens were cached.
OTHER_ROUTES: dict[str, tuple[Any, Any]] = {
    "/v1/responses": (  # store: false: vLLM's handler (a stored response is a session: tests above)
        lambda text: {"input": text, "max_output_tokens": 1, "store": False},
        lambda usage: usage["input_tokens_details"]["cached_tokens"],
    ),
    "/v1/messages": (
        lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 1},
        lambda usage: usage["cache_read_input_tokens"],
    ),
    "/v1/chat/completions": (
        lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 1},
        lambda usage: usage["prompt_tokens_details"]["cached_tokens"],
    ),
    "/invocations": (
        lambda text: {"prompt": text, "max_tokens": 1},
        lambda usage: usage["prompt_tokens_details"]["cached_tokens"],
    ),
}


async def cached_on(http: httpx.AsyncClient, path: str, text: str, headers: dict[str, str]) -> int:
    body, cached = OTHER_ROUTES[path]
    reply = await http.post(path, headers=headers, json={"model": "embedded-tiny", "temperature": 0, **body(text)})
    assert reply.status_code == 200, reply.text
    return int(cached(reply.json()["usage"]))


async def realtime_turn(server: str, text: str, headers: dict[str, str]) -> int:
    """One Realtime (GA) turn on a session of its own: how many of its prompt tokens were
    cached, as its ``response.done`` usage says."""
    url = server.replace("http://", "ws://") + "/v1/realtime?model=embedded-tiny"
    async with websockets.connect(url, additional_headers=headers) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 1}}))
        while (event := json.loads(await ws.recv()))["type"] != "response.done":
            assert event["type"] != "error", event
    return int(event["response"]["usage"]["input_token_details"]["cached_tokens"])


@pytest.mark.parametrize("path", sorted(OTHER_ROUTES))
async def test_every_generating_route_keeps_keys_apart(server: str, path: str) -> None:
    text = text_prompt(sorted(OTHER_ROUTES).index(path))
    async with httpx.AsyncClient(base_url=server, timeout=120) as http:
        await cached_on(http, path, text, ALICE)
        assert await cached_on(http, path, text, ALICE) >= 192  # the positive control
        assert await cached_on(http, path, text, BOB) == 0


async def test_a_key_sees_none_of_another_keys_cached_prompt(server: str) -> None:
    # A prompt per probe: each of Bob's probes caches under Bob's own salt.
    by_completion, by_session, by_websocket, from_tier = (prompt(seed) for seed in (11, 12, 13, 14))
    async with httpx.AsyncClient(base_url=server, timeout=120) as http:
        for secret in (by_completion, by_session, by_websocket, from_tier):
            assert (await session_on(http, secret, ALICE))["computed_tokens"] == 256
        # Bob, every way in: nothing cached.
        for probe in (
            await completion_on(http, by_completion, BOB),
            await session_on(http, by_session, BOB),
            await websocket_chunk(server, by_websocket, BOB),
        ):
            assert probe["cached_tokens"] == probe["device_tokens"] == probe["cpu_tier_tokens"] == 0, probe
        # Nor over Realtime.
        text = text_prompt(50)
        await realtime_turn(server, text, ALICE)
        assert await realtime_turn(server, text, ALICE) >= 192  # the positive control
        assert await realtime_turn(server, text, BOB) == 0
        # Nor by choosing a cache salt of his own: it stays within his key.
        assert (await completion_on(http, from_tier, BOB, cache_salt="anything"))["cached_tokens"] == 0
        # Alice's own requests still reuse her prefix (the positive control).
        assert (await completion_on(http, by_completion, ALICE))["device_tokens"] >= 224

        # From the CPU tier, after the device cache is dropped: the same.
        await park_idle_sessions_of_running_apps()  # open ones of this and other modules
        assert (await http.post("/v1/admin/reset_device_cache", headers=ALICE)).status_code == 200
        bob = await completion_on(http, from_tier[:224], BOB)
        assert bob["cached_tokens"] == bob["cpu_tier_tokens"] == 0, bob
        alice = await completion_on(http, from_tier[:224], ALICE)
        assert alice["cpu_tier_tokens"] >= 192, alice


async def test_negative_control_shared_caches_let_keys_probe_each_other(engine: Any) -> None:
    settings = make_settings(api_keys=list(API_KEYS), cache_isolation="shared")
    secret = prompt(2)
    async with running_app(settings, engine) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
        await session_on(http, secret, ALICE)
        leaked = await completion_on(http, secret, BOB)
        assert leaked["cached_tokens"] >= 224, leaked
        for path in ("/v1/responses", "/v1/chat/completions"):
            text = text_prompt(100 + len(path))
            await cached_on(http, path, text, ALICE)
            assert await cached_on(http, path, text, BOB) >= 192, path
        text = text_prompt(150)
        await realtime_turn(url, text, ALICE)
        assert await realtime_turn(url, text, BOB) >= 192
        # And from the CPU tier, once the device cache is dropped.
        from_tier = prompt(3)
        await session_on(http, from_tier, ALICE)
        await park_idle_sessions_of_running_apps()
        assert (await http.post("/v1/admin/reset_device_cache", headers=ALICE)).status_code == 200
        leaked = await completion_on(http, from_tier[:224], BOB)
        assert leaked["cpu_tier_tokens"] >= 192, leaked
