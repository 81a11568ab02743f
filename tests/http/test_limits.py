"""Per-key rate and size limits, on the real app over real HTTP and websockets.

Each limit is set low on a server of its own (the shared engine under it) and then
crossed: the request over it gets 429 in the OpenAI shape with Retry-After (or, on a
websocket, an error event or a close), the other key is untouched, and the key's
sessions are still usable. Oracle: the status, error code and event stream; no
timing is asserted (the windows are a minute, so nothing here waits them out).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import websockets

from tests.conftest import API_KEYS, auth, make_settings
from tests.helpers import close_code, running_app

pytestmark = pytest.mark.server

ALICE, BOB = (auth(key) for key in API_KEYS)


def limited(**limits: Any) -> Any:
    return make_settings(api_keys=list(API_KEYS), **limits)


def assert_rate_limited(response: httpx.Response, kind: str) -> None:
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert response.json()["error"]["type"] == kind
    assert int(response.headers["retry-after"]) >= 1


async def test_requests_per_minute_refuse_the_key_over_it_and_only_that_key(engine: Any) -> None:
    async with (
        running_app(limited(rate_limit_requests_per_minute=4), engine) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        created = await http.post("/v1/sessions", json={}, headers=ALICE)
        session_id = created.json()["id"]
        for _ in range(3):
            assert (await http.get(f"/v1/sessions/{session_id}", headers=ALICE)).status_code == 200
        assert_rate_limited(await http.get(f"/v1/sessions/{session_id}", headers=ALICE), "requests")
        # A websocket connection counts too, and is refused with an error event and 1008.
        ws_url = url.replace("http://", "ws://") + "/v1/sessions/ws"
        async with websockets.connect(ws_url, additional_headers=ALICE) as ws:
            event = json.loads(await ws.recv())
            assert event["type"] == "error" and event["error"]["code"] == "rate_limit_exceeded", event
            assert await close_code(ws) == 1008
        # Bob's budget is his own; probes are never limited.
        assert (await http.post("/v1/sessions", json={}, headers=BOB)).status_code == 201
        assert (await http.get("/health")).status_code == 200


async def test_tokens_per_minute_count_chunks_and_completions(engine: Any) -> None:
    async with (
        running_app(limited(rate_limit_tokens_per_minute=100), engine) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        session_id = (await http.post("/v1/sessions", json={}, headers=ALICE)).json()["id"]
        chunk = {"input": list(range(1, 41)), "max_tokens": 20}  # 60 tokens
        assert (await http.post(f"/v1/sessions/{session_id}/chunks", json=chunk, headers=ALICE)).status_code == 200
        refused = await http.post(f"/v1/sessions/{session_id}/chunks", json=chunk, headers=ALICE)
        assert_rate_limited(refused, "tokens")
        # The refused chunk left the session as it was.
        assert (await http.get(f"/v1/sessions/{session_id}", headers=ALICE)).json()["num_chunks"] == 1
        # /v1/completions draws on the same budget: 30 prompt + 10 output fits, then nothing does.
        completion = {"model": "embedded-tiny", "prompt": list(range(1, 31)), "max_tokens": 10}
        assert (await http.post("/v1/completions", json=completion, headers=ALICE)).status_code == 200
        assert_rate_limited(await http.post("/v1/completions", json=completion, headers=ALICE), "tokens")
        # A request larger than the whole budget says so.
        huge = await http.post("/v1/completions", json={**completion, "max_tokens": 200}, headers=BOB)
        assert huge.status_code == 429 and "more than this API key's limit" in huge.json()["error"]["message"]
        # Bob's own budget is untouched by Alice's.
        assert (await http.post("/v1/completions", json=completion, headers=BOB)).status_code == 200


async def test_websocket_connections_events_and_frames_are_bounded_per_key(engine: Any) -> None:
    settings = limited(ws_max_connections_per_key=2, ws_events_per_second=5, ws_max_message_bytes=64 * 1024)
    async with running_app(settings, engine) as url:
        ws_url = url.replace("http://", "ws://") + "/v1/sessions/ws"
        async with (
            websockets.connect(ws_url, additional_headers=ALICE) as first,
            websockets.connect(ws_url, additional_headers=ALICE) as second,
        ):
            for ws in (first, second):
                assert json.loads(await ws.recv())["type"] == "session.created"
            # A third connection of Alice's is refused; Bob's is not.
            async with websockets.connect(ws_url, additional_headers=ALICE) as third:
                event = json.loads(await third.recv())
                assert event["error"]["code"] == "too_many_connections", event
            async with websockets.connect(ws_url, additional_headers=BOB) as bobs:
                assert json.loads(await bobs.recv())["type"] == "session.created"

            # A flood of events on one connection: the ones over the rate get error
            # events and are dropped; the connection and its session go on.
            for _ in range(12):
                await first.send(json.dumps({"type": "session.update", "session": {"temperature": 0}}))
            replies = [json.loads(await first.recv()) for _ in range(12)]
            codes = [r["error"]["code"] for r in replies if r["type"] == "error"]
            assert codes and set(codes) == {"rate_limit_exceeded"}, replies
            assert any(r["type"] == "session.updated" for r in replies)
            await asyncio.sleep(1.1)  # the per-second window moves on
            await first.send(json.dumps({"type": "input.append", "input": [5, 6, 7], "max_tokens": 2}))
            while (event := json.loads(await first.recv()))["type"] != "response.done":
                assert event["type"] == "response.output.delta", event

            # A message over the size limit closes its connection with 1009 (message too big) ...
            await second.send(json.dumps({"type": "input.append", "input": "x" * (100 * 1024)}))
            assert await close_code(second) == 1009
            # ... and nothing else: the first connection's session still answers.
            await first.send(json.dumps({"type": "input.append", "input": [8], "max_tokens": 1}))
            while (event := json.loads(await first.recv()))["type"] != "response.done":
                pass


async def test_negative_control_without_limits_the_same_traffic_passes(engine: Any) -> None:
    """The traffic each test above sends, on a server with no per-key limits: nothing is
    refused, so the refusals above are the limits' own."""
    async with running_app(limited(), engine) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        session_id = (await http.post("/v1/sessions", json={}, headers=ALICE)).json()["id"]
        for _ in range(5):
            assert (await http.get(f"/v1/sessions/{session_id}", headers=ALICE)).status_code == 200
        chunk = {"input": list(range(1, 41)), "max_tokens": 20}
        for _ in range(2):
            assert (await http.post(f"/v1/sessions/{session_id}/chunks", json=chunk, headers=ALICE)).status_code == 200
        completion = {"model": "embedded-tiny", "prompt": list(range(1, 31)), "max_tokens": 200}
        assert (await http.post("/v1/completions", json=completion, headers=ALICE)).status_code == 200
        ws_url = url.replace("http://", "ws://") + "/v1/sessions/ws"
        async with (
            websockets.connect(ws_url, additional_headers=ALICE) as first,
            websockets.connect(ws_url, additional_headers=ALICE) as second,
            websockets.connect(ws_url, additional_headers=ALICE) as third,
        ):
            for ws in (first, second, third):
                assert json.loads(await ws.recv())["type"] == "session.created"
            for _ in range(12):
                await first.send(json.dumps({"type": "session.update", "session": {"temperature": 0}}))
            replies = [json.loads(await first.recv()) for _ in range(12)]
            assert [r["type"] for r in replies] == ["session.updated"] * 12, replies
