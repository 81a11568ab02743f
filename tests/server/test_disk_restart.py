"""A server with a disk tier, killed (SIGKILL) with a parked and an active session, and
started again: each session's next chunk loads its context from disk, says so in its
usage (``disk_tier_tokens``) and in the metrics, and answers as before the kill. Then a
graceful stop (SIGTERM) with both sessions active and a websocket-owned one open: the
next server loads their whole contexts from disk (the stop parks them and flushes the
tier before the engine stops), and the websocket's session, closed with code 1012 but
parked, not closed, goes on.

Real server processes (``python -m app.main``, embedded tiny model, float32) on one
state directory (SQLite store, disk tier in ``state_dir/disk_tier``). Oracle: a control
session on the first server runs the same chunks uninterrupted; float32 makes the
restarted sessions' answers comparable with it token for token. After a restart the
device cache and the CPU tier are empty, so a hit can only come from the disk.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.harness.servers import free_port
from tests.server.test_durable_restart import (
    CHUNKS,
    MAX_TOKENS,
    durable_server,
    kill_hard,
    open_session,
    send,
    transcript_ids,
)

pytestmark = pytest.mark.server

BLOCK = 32  # the server's block size (the default)


def chunks(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 700) for _ in range(100)] for _ in range(3)]


def status(http: httpx.Client, session_id: str) -> str:
    return str(http.get(f"/v1/sessions/{session_id}").json()["status"])


def test_sessions_resume_from_disk_after_sigkill(tmp_path: Path) -> None:
    state_dir, port = tmp_path / "state", free_port()
    extra = {"disk_tier_gib": "1", "session_park_after_s": "600"}  # parked on request only
    parked_chunks, active_chunks = chunks(1), chunks(2)
    with (
        durable_server("first", state_dir, port, tmp_path, **extra) as server,
        httpx.Client(base_url=server.base_url, timeout=120) as http,
    ):
        expected = {}
        for name, inputs in (("parked", parked_chunks), ("active", active_chunks)):
            control = open_session(http)
            expected[name] = [send(http, control, chunk)["output"]["token_ids"] for chunk in inputs]
        parked = open_session(http)
        for chunk in parked_chunks[:2]:
            send(http, parked, chunk)
        assert http.post(f"/v1/sessions/{parked}/park").status_code == 200
        assert status(http, parked) == "parked"
        reused = open_session(http)  # its transcript is sent to /v1/completions after the restart
        send(http, reused, chunks(5)[0])
        active = open_session(http)
        for chunk in active_chunks[:2]:
            send(http, active, chunk)
        contexts = {
            "parked": transcript_ids(http, parked),
            "active": transcript_ids(http, active),
            "reused": transcript_ids(http, reused),
        }
        assert status(http, active) == "active"
        kill_hard(server)

    with (
        contextlib.ExitStack() as stack,
        durable_server("restarted", state_dir, port, tmp_path, **extra) as server,
        httpx.Client(base_url=server.base_url, timeout=120) as http,
    ):
        for name, session, inputs in (("parked", parked, parked_chunks), ("active", active, active_chunks)):
            resumed = send(http, session, inputs[2])
            assert resumed["output"]["token_ids"] == expected[name][2], name
            details = resumed["usage"]["prompt_tokens_details"]
            assert details["cpu_tier_tokens"] == 0 and details["device_tokens"] == 0, details
            # A parked session's whole context was stored (our tail store); an active
            # one's last outputs were not yet (they become prompt with its next chunk).
            whole = len(contexts[name]) // BLOCK * BLOCK
            wanted = whole if name == "parked" else whole - BLOCK
            assert details["disk_tier_tokens"] >= wanted, (name, details, len(contexts[name]))
            assert details["cached_tokens"] == details["disk_tier_tokens"]
        # vLLM's own route reuses a session's prefix from disk too, and its usage says so.
        completion = http.post(
            "/v1/completions", json={"model": "embedded-tiny", "prompt": contexts["reused"], "max_tokens": 1}
        )
        assert completion.status_code == 200, completion.text
        details = completion.json()["usage"]["prompt_tokens_details"]
        assert details["disk_tier_tokens"] >= len(contexts["reused"]) // BLOCK * BLOCK - BLOCK, details
        assert details["cpu_tier_tokens"] == 0, details
        metrics = http.get("/metrics").text
        assert 'streamsess_session_resumes_total{source="disk_tier"} 2.0' in metrics
        files = next(line for line in metrics.splitlines() if line.startswith("vllm:kv_offload_disk_tier_files"))
        assert float(files.rsplit(" ", 1)[1]) >= len(contexts["parked"]) // BLOCK
        # A chunk no control session had: its blocks reach the disk only from this server.
        for session, seed in ((parked, 3), (active, 4)):
            send(http, session, chunks(seed)[0])
        contexts = {"parked": transcript_ids(http, parked), "active": transcript_ids(http, active)}
        assert status(http, parked) == status(http, active) == "active"
        # A session owned by an open websocket, and a control with the same chunks over REST.
        ws_control = open_session(http)
        ws_expected = [send(http, ws_control, chunk)["output"]["token_ids"] for chunk in CHUNKS[:2]]
        owned_ws = stack.enter_context(ws_connect(server.base_url.replace("http://", "ws://") + "/v1/sessions/ws"))
        over_ws = json.loads(owned_ws.recv(timeout=60))["session"]["id"]
        owned_ws.send(json.dumps({"type": "session.update", "session": {"temperature": 0, "ignore_eos": True}}))
        assert json.loads(owned_ws.recv(timeout=60))["type"] == "session.updated"
        owned_ws.send(json.dumps({"type": "input.append", "input": CHUNKS[0], "max_tokens": MAX_TOKENS}))
        while json.loads(owned_ws.recv(timeout=60))["type"] != "response.done":
            pass
        ws_transcript = transcript_ids(http, over_ws)
        # SIGTERM to the server alone, as a container runtime sends it to its main process
        # (a restart, a rolling upgrade, a scale-in): a server stop is not a client leaving.
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises it after its stop
        with pytest.raises(ConnectionClosed) as closed_by_server:
            owned_ws.recv(timeout=30)
        assert closed_by_server.value.rcvd is not None and closed_by_server.value.rcvd.code == 1012

    with (
        durable_server("after-sigterm", state_dir, port, tmp_path, **extra) as server,
        httpx.Client(base_url=server.base_url, timeout=120) as http,
    ):
        for name, session in (("parked", parked), ("active", active)):
            assert status(http, session) == "parked", name  # parked by the stop, not closed
            resumed = send(http, session, [5, 6, 7])
            details = resumed["usage"]["prompt_tokens_details"]
            # Every token with KV: all but the last one sampled.
            assert details["disk_tier_tokens"] == (len(contexts[name]) - 1) // BLOCK * BLOCK, (name, details)
        # The websocket's session was parked by the stop, not closed with its connection.
        state = http.get(f"/v1/sessions/{over_ws}").json()
        assert (state["status"], state["num_chunks"]) == ("parked", 1), state
        assert transcript_ids(http, over_ws) == ws_transcript
        assert send(http, over_ws, CHUNKS[1])["output"]["token_ids"] == ws_expected[1]
