"""Sessions outlive their server: SIGKILL between chunks, during one, and right after a
resumed one (a graceful stop, SIGTERM, is tests/server/test_disk_restart.py's).

Real server processes (``python -m app.main``, embedded tiny model, float32) on one
SQLite store (the default) in a temporary state directory. The killed server is
started again with the same settings and port, so it is the same replica.

Oracle: an uninterrupted session on the same server runs the same chunks first;
the interrupted session's outputs must equal it token for token. The restarted
server's CPU tier is empty (host memory), so its first chunk of the session
recomputes the transcript: float32 makes a recompute comparable token for token
with the incremental run (see docs/correctness.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness.servers import RunningServer, app_server, free_port

pytestmark = pytest.mark.server

CHUNKS: list[list[int]] = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34], [41, 42]]
MAX_TOKENS = 6


@contextlib.contextmanager
def durable_server(name: str, state_dir: Path, port: int, log_dir: Path, **extra: str) -> Iterator[RunningServer]:
    settings = {
        "state_dir": str(state_dir),
        "dtype": "float32",
        "kv_cache_gib": "0.25",
        "cpu_tier_gib": "0.5",
        "max_num_seqs": "8",
        "max_chunk_output_tokens": "4000",
        "log_level": "warning",
        **extra,
    }
    with app_server(name, log_dir / f"{name}.log", settings, port=port) as server:
        yield server


def kill_hard(server: RunningServer) -> None:
    """SIGKILL to the server and its engine processes, as a crash or an OOM kill."""
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)


def open_session(http: httpx.Client) -> str:
    created = http.post("/v1/sessions", json={"defaults": {"temperature": 0, "ignore_eos": True}})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def send(http: httpx.Client, session_id: str, chunk: list[int], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    response = http.post(f"/v1/sessions/{session_id}/chunks", json={"input": chunk, "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    return dict(response.json())


TURNS = ["first turn", "second turn", "third turn"]


def respond_chain(http: httpx.Client, turns: list[str], previous: str | None = None) -> list[dict[str, Any]]:
    """Responses that continue one another (``previous_response_id``), greedy."""
    responses = []
    for text in turns:
        body = {
            "model": "embedded-tiny",
            "input": text,
            "max_output_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "previous_response_id": previous,
        }
        response = http.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        responses.append(response.json())
        previous = responses[-1]["id"]
    return responses


def transcript_ids(http: httpx.Client, session_id: str) -> list[int]:
    response = http.get(f"/v1/sessions/{session_id}/transcript")
    assert response.status_code == 200, response.text
    return list(response.json()["token_ids"])


def test_sessions_survive_sigkill_between_and_during_chunks(tmp_path: Path) -> None:
    state_dir, port = tmp_path / "state", free_port()

    with (
        durable_server("first", state_dir, port, tmp_path) as server,
        httpx.Client(base_url=server.base_url, timeout=120) as http,
    ):
        control = open_session(http)
        expected = [send(http, control, chunk)["output"]["token_ids"] for chunk in CHUNKS]
        between = open_session(http)
        for chunk in CHUNKS[:2]:
            send(http, between, chunk)
        before_kill = transcript_ids(http, between)
        # A previous_response_id chain, and an uninterrupted one to compare with.
        control_chain = respond_chain(http, TURNS)
        chain = respond_chain(http, TURNS[:2])
        during = open_session(http)
        send(http, during, CHUNKS[0])
        during_before = transcript_ids(http, during)
        # A long chunk (seconds of decoding), streaming; the server dies after its first tokens.
        with http.stream(
            "POST", f"/v1/sessions/{during}/chunks", json={"input": [99] * 40, "max_tokens": 3000, "stream": True}
        ) as stream:
            assert stream.status_code == 200
            assert any(line.startswith("data: ") and "delta" in line for line in stream.iter_lines())
            kill_hard(server)  # right after the first delta

    with (
        durable_server("restarted", state_dir, port, tmp_path) as server,
        httpx.Client(base_url=server.base_url, timeout=120) as http,
    ):
        # Killed between chunks: same id, the transcript kept, parked.
        state = http.get(f"/v1/sessions/{between}").json()
        assert (state["status"], state["num_chunks"], state["num_tokens"]) == ("parked", 2, len(before_kill))
        assert transcript_ids(http, between) == before_kill
        listed = {s["id"] for s in http.get("/v1/sessions").json()["data"]}
        assert {control, between, during} <= listed
        resumed = send(http, between, CHUNKS[2])
        assert resumed["output"]["token_ids"] == expected[2]
        # The CPU tier died with the process: the transcript is recomputed, and the usage says so.
        details = resumed["usage"]["prompt_tokens_details"]
        assert details["cpu_tier_tokens"] == 0
        assert details["computed_tokens"] == resumed["usage"]["prompt_tokens"] - details["device_tokens"]
        assert details["computed_tokens"] >= len(before_kill) - 32  # at most a block of device hits
        assert send(http, between, CHUNKS[3])["output"]["token_ids"] == expected[3]
        # The chain's next turn, after the kill: answered as without it, token for token.
        chain += respond_chain(http, TURNS[2:], previous=chain[-1]["id"])
        assert [r["output"][0]["content"][0]["text"] for r in chain] == [
            r["output"][0]["content"][0]["text"] for r in control_chain
        ]
        assert transcript_ids(http, chain[0]["id"]) == transcript_ids(http, control_chain[0]["id"])

        # Killed during a chunk: that chunk is not in the transcript, and the session goes on.
        state = http.get(f"/v1/sessions/{during}").json()
        assert (state["status"], state["num_chunks"]) == ("parked", 1)
        assert transcript_ids(http, during) == during_before
        assert send(http, during, CHUNKS[1])["output"]["token_ids"] == expected[1]
        kill_hard(server)  # and once more, right after a resumed chunk

    with (
        durable_server("again", state_dir, port, tmp_path) as server,
        httpx.Client(base_url=server.base_url, timeout=120) as http,
    ):
        assert http.get(f"/v1/sessions/{during}").json()["num_chunks"] == 2
        assert send(http, during, CHUNKS[2])["output"]["token_ids"] == expected[2]
        assert http.delete(f"/v1/sessions/{control}").status_code == 200
        assert http.get(f"/v1/sessions/{control}").status_code == 404  # deleted: gone
    # A graceful stop (SIGTERM) with a websocket-owned session open: tests/server/test_disk_restart.py.
