"""When the session store fails: clear 503s, nothing half-written, recovery after.

The real app over real HTTP on the shared float32 engine, with its store on a
full filesystem (SQLite on a small tmpfs the test mounts and fills) and on a
PostgreSQL server the test stops and starts again, once between chunks and once
in the middle of one. Oracle: an uninterrupted session on the same app runs the
same chunks; after recovery the failed session's outputs equal it token for
token (float32), so no failure left a trace in its context.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import API_KEYS, auth, make_settings
from tests.helpers import running_app
from tests.http.test_errors import assert_openai_error
from tests.postgres import needs_postgres, postgres_server

pytestmark = pytest.mark.server

CHUNKS: list[list[int]] = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34]]
MAX_TOKENS = 6


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "4m") -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the filesystem is full."""
    filler = directory / "filler"
    with filler.open("wb") as out:
        block = b"\0" * 65536
        try:
            while True:
                out.write(block)
                out.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


async def open_session(http: httpx.AsyncClient) -> str:
    created = await http.post("/v1/sessions", json={"defaults": {"temperature": 0, "ignore_eos": True}})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


async def send(http: httpx.AsyncClient, session_id: str, chunk: list[int]) -> httpx.Response:
    return await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": chunk, "max_tokens": MAX_TOKENS})


async def expected_outputs(http: httpx.AsyncClient) -> list[list[int]]:
    control = await open_session(http)
    outputs = []
    for chunk in CHUNKS:
        response = await send(http, control, chunk)
        assert response.status_code == 200, response.text
        outputs.append(response.json()["output"]["token_ids"])
    return outputs


async def control_and_victim(http: httpx.AsyncClient) -> tuple[list[list[int]], str, list[int]]:
    """The control's outputs, and a session that has answered the first chunk, with its transcript."""
    expected = await expected_outputs(http)
    victim = await open_session(http)
    assert (await send(http, victim, CHUNKS[0])).status_code == 200
    transcript = (await http.get(f"/v1/sessions/{victim}/transcript")).json()["token_ids"]
    return expected, victim, transcript


async def assert_goes_on_as_the_control(http: httpx.AsyncClient, session_id: str, expected: list[list[int]]) -> None:
    """The rest of the conversation answers, token for token as the uninterrupted control."""
    for index in (1, 2):
        response = await send(http, session_id, CHUNKS[index])
        assert response.status_code == 200, response.text
        assert response.json()["output"]["token_ids"] == expected[index]


async def assert_state(http: httpx.AsyncClient, session_id: str, num_chunks: int, transcript: list[int]) -> None:
    state = (await http.get(f"/v1/sessions/{session_id}")).json()
    assert state["num_chunks"] == num_chunks and state["status"] != "closed", state
    assert (await http.get(f"/v1/sessions/{session_id}/transcript")).json()["token_ids"] == transcript


async def test_a_full_disk_gives_503s_and_the_server_recovers_when_space_returns(engine: Any, tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "state") as state_dir:
        settings = make_settings(api_keys=list(API_KEYS), state_dir=str(state_dir))
        async with (
            running_app(settings, engine) as url,
            httpx.AsyncClient(base_url=url, headers=auth(), timeout=120) as http,
        ):
            expected, victim, transcript = await control_and_victim(http)

            filler = await asyncio.to_thread(fill, state_dir)
            refused = assert_openai_error(await send(http, victim, CHUNKS[1]), 503, "store_unavailable")
            assert "nothing was changed" in refused["message"].lower()
            assert_openai_error(await http.post("/v1/sessions"), 503, "store_unavailable")
            await assert_state(http, victim, 1, transcript)

            filler.unlink()
            await assert_goes_on_as_the_control(http, victim, expected)
            assert (await http.post("/v1/sessions")).status_code == 201


@needs_postgres
async def test_a_stopped_postgres_gives_503s_undoes_the_chunk_it_interrupted_and_recovers(engine: Any) -> None:
    with postgres_server() as database:
        settings = make_settings(api_keys=list(API_KEYS), store_url=database.url, max_chunk_output_tokens=4000)
        async with (
            running_app(settings, engine) as url,
            httpx.AsyncClient(base_url=url, headers=auth(), timeout=120) as http,
        ):
            expected, victim, transcript = await control_and_victim(http)

            # The database goes away while a long chunk is answering: its answer
            # cannot be kept, so it ends with an error, and the chunk is undone.
            events = await stream_while(http, victim, lambda: database.stop("immediate"))
            assert events[-1]["error"]["code"] == "store_unavailable", events[-3:]
            assert any("delta" in event for event in events[:-1])
            # Down: new sessions, chunks and lists fail fast, in the OpenAI shape.
            assert_openai_error(await http.post("/v1/sessions"), 503, "store_unavailable")
            assert_openai_error(await send(http, victim, CHUNKS[1]), 503, "store_unavailable")
            assert_openai_error(await http.get("/v1/sessions"), 503, "store_unavailable")
            await assert_state(http, victim, 1, transcript)

            await asyncio.to_thread(database.start)
            await assert_goes_on_as_the_control(http, victim, expected)
            assert victim in {s["id"] for s in (await http.get("/v1/sessions")).json()["data"]}


async def stream_while(http: httpx.AsyncClient, session_id: str, action: Any) -> list[dict[str, Any]]:
    """Stream a long chunk, run ``action`` (in a thread) after its first delta, and
    return every event of the stream."""
    events: list[dict[str, Any]] = []
    body = {"input": [99] * 8, "max_tokens": 2000, "stream": True}  # seconds of decoding
    async with http.stream("POST", f"/v1/sessions/{session_id}/chunks", json=body) as stream:
        async for line in stream.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if len(events) == 1:
                await asyncio.to_thread(action)
    return events
