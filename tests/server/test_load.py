"""Load held, proved in the repo: 64 websocket sessions at once, 20 chunks each.

The real app over real websockets on the shared engine, whose 16 engine slots are
fewer than the sessions, so sessions park and resume under load. Every chunk must
be answered (0 errors), and afterwards no engine request and no session is left.
No timings are asserted.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import pytest
import websockets

from tests.conftest import API_KEYS, auth, make_settings
from tests.helpers import live_request_ids, running_app, until

pytestmark = pytest.mark.server

SESSIONS, CHUNKS = 64, 20


async def one_session(url: str, seed: int) -> tuple[str, int]:
    rng = random.Random(seed)
    async with websockets.connect(url, additional_headers=auth(), max_size=2**22) as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created", created
        answered = 0
        for _ in range(CHUNKS):
            chunk = [rng.randrange(1, 700) for _ in range(8)]
            await ws.send(json.dumps({"type": "input.append", "input": chunk, "max_tokens": 4, "ignore_eos": True}))
            while (event := json.loads(await ws.recv()))["type"] != "response.done":
                assert event["type"] == "response.output.delta", event
            assert event["usage"]["completion_tokens"] == 4
            answered += 1
        await ws.send(json.dumps({"type": "session.close"}))
        return created["session"]["id"], answered


async def test_64_websocket_sessions_of_20_chunks_all_answer_and_leave_nothing(engine: Any) -> None:
    settings = make_settings(api_keys=list(API_KEYS), max_sessions=SESSIONS, admission_timeout_s=120.0)
    async with running_app(settings, engine) as url:
        ws_url = url.replace("http://", "ws://") + "/v1/sessions/ws"
        results = await asyncio.gather(*(one_session(ws_url, seed) for seed in range(SESSIONS)))
        assert sum(answered for _, answered in results) == SESSIONS * CHUNKS
        ids = {session_id for session_id, _ in results}
        assert len(ids) == SESSIONS
        assert await until(lambda: not (live_request_ids(engine) & ids), timeout_s=30)
        async with httpx.AsyncClient(base_url=url, headers=auth(), timeout=30) as http:
            listed = {s["id"] for s in (await http.get("/v1/sessions")).json()["data"]}
        assert not (listed & ids)  # every session closed
