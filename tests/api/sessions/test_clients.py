"""The Python clients (async and sync, REST and websocket) and the CLI, against the real server."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients import (
    AsyncSessionsClient,
    AuthenticationError,
    ConflictError,
    NotFoundError,
    SessionsClient,
)
from tests.conftest import API_KEYS, auth

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parents[3]
CHUNKS: list[Any] = ["The quick brown fox", [11, 12, 13, 14, 15], " jumps over the lazy dog."]
DEFAULTS = {"temperature": 0, "ignore_eos": True, "max_tokens": 5}


async def reference_outputs(server: str) -> list[list[int]]:
    """The server's own answer to CHUNKS, over raw HTTP."""
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=120) as http:
        session_id = (await http.post("/v1/sessions", json={"defaults": DEFAULTS})).json()["id"]
        outputs = []
        for chunk in CHUNKS:
            body = (await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": chunk})).json()
            outputs.append(body["output"]["token_ids"])
        await http.delete(f"/v1/sessions/{session_id}")
    return outputs


@pytest.mark.parametrize("transport", ["rest", "websocket"])
async def test_async_client(server: str, transport: str) -> None:
    expected = await reference_outputs(server)
    async with AsyncSessionsClient(server, API_KEYS[0]) as client:
        async with client.sessions.create(defaults=DEFAULTS, transport=transport) as session:  # type: ignore[arg-type]
            assert session.transport == transport
            first = await session.send(CHUNKS[0])
            streamed = [delta async for delta in session.stream(CHUNKS[1])]
            third = await session.send(CHUNKS[2])
            assert session.last_reply is third
            got = [first.token_ids, [t for d in streamed for t in d.token_ids], third.token_ids]
            assert got == expected
            assert third.index == 2 and third.usage.prompt_tokens_details.device_tokens > 0
            transcript = await session.transcript()
            assert transcript.num_tokens == (await session.refresh()).num_tokens
            session_id = session.id
        # Leaving the block closed the session: over REST with a DELETE, after which it is
        # gone (404, as OpenAI's deleted objects); a websocket's closes with its connection.
        if transport == "rest":
            with pytest.raises(NotFoundError):
                await client.sessions.retrieve(session_id)
        else:
            assert (await client.sessions.retrieve(session_id)).status == "closed"


def _sync_session(server: str, transport: str) -> list[list[int]]:
    with (
        SessionsClient(server, API_KEYS[0]) as client,
        client.sessions.create(
            defaults=DEFAULTS,
            transport=transport,  # type: ignore[arg-type]
        ) as session,
    ):
        first = session.send(CHUNKS[0])
        streamed = [t for delta in session.stream(CHUNKS[1]) for t in delta.token_ids]
        assert session.last_reply is not None and session.last_reply.token_ids == streamed
        third = session.send(CHUNKS[2])
        return [first.token_ids, streamed, third.token_ids]


@pytest.mark.parametrize("transport", ["rest", "websocket"])
async def test_sync_client(server: str, transport: str) -> None:
    expected = await reference_outputs(server)
    # The server runs on this test's event loop: the blocking client runs in a thread.
    assert await asyncio.to_thread(_sync_session, server, transport) == expected


async def test_errors_are_typed(server: str) -> None:
    async with AsyncSessionsClient(server, API_KEYS[0]) as client:
        with pytest.raises(NotFoundError) as missing:
            await client.sessions.retrieve("sess_missing")
        assert missing.value.status_code == 404 and missing.value.code == "session_not_found"
        session = await client.sessions.create()
        busy = asyncio.create_task(session.send([3] * 10, max_tokens=1000))
        for _ in range(500):
            if (await client.sessions.retrieve(session.id)).status == "generating":
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("the first chunk never started generating within 5 s")
        with pytest.raises(ConflictError) as in_flight:
            await session.send([4], max_tokens=1)
        assert in_flight.value.code == "chunk_in_flight"
        await busy
        await client.sessions.delete(session.id)
        with pytest.raises(NotFoundError) as deleted:  # deleted: gone, as OpenAI's objects
            await session.send("late")
        assert deleted.value.status_code == 404 and deleted.value.code == "session_not_found"
    async with AsyncSessionsClient(server, "wrong-key") as stranger:
        with pytest.raises(AuthenticationError) as denied:
            await stranger.sessions.list()
        assert denied.value.status_code == 401 and denied.value.type == "authentication_error"

    def websocket_with_wrong_key() -> None:
        with SessionsClient(server, API_KEYS[0]) as owner:
            session = owner.sessions.create()
            try:
                with SessionsClient(server, "wrong-key") as stranger:
                    stranger.sessions.attach(session.id, transport="websocket")
            finally:
                session.close()

    with pytest.raises(AuthenticationError):
        await asyncio.to_thread(websocket_with_wrong_key)


# The pages whose Python examples run against a real server: the README's, and the manual's
# pages that hold the rest (each example once).
EXAMPLE_PAGES = ("README.md", "docs/sessions.md", "docs/openai.md")


def documented_python_blocks() -> list[str]:
    blocks = [
        block
        for page in EXAMPLE_PAGES
        for block in re.findall(r"```python\n(.*?)```", (REPO / page).read_text(), flags=re.DOTALL)
    ]
    return list(dict.fromkeys(blocks))


async def run_python(
    code: str, server: str, *args: str, stdin: bytes | None = None, model: str = "embedded-tiny"
) -> tuple[int, str, str]:
    env = {
        **os.environ,
        "STREAMSESS_BASE_URL": server,
        "STREAMSESS_API_KEY": API_KEYS[0],
        "STREAMSESS_MODEL": model,
        "PYTHONPATH": str(REPO),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *(("-c", code) if code else ()),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    out, err = await asyncio.wait_for(process.communicate(stdin), 300)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_documented_examples_run(server: str) -> None:
    """Every example of the README and the manual but the tool calling one, which needs a
    model that can call tools (test_fresh_server runs it on the default model)."""
    blocks = [block for block in documented_python_blocks() if not is_tool_example(block)]
    assert len(blocks) == 4  # Realtime, Responses, the async and the sync client
    await _run_documented_blocks(blocks, server)


def is_tool_example(block: str) -> bool:
    return "tool_choice=" in block


async def _run_documented_blocks(blocks: list[str], server: str) -> None:
    outputs = []
    try:
        for block in blocks:
            code, out, err = await run_python(block, server)
            assert code == 0, f"README example failed:\n{block}\n--- stderr ---\n{err}"
            assert out.strip(), block
            outputs.append(out)
    finally:
        # The Responses example leaves a chain and a conversation open (sessions holding
        # device blocks): later tests reset the device cache, which open sessions refuse.
        async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
            for session in (await http.get("/v1/sessions")).json()["data"]:
                await http.delete(f"/v1/sessions/{session['id']}")
    # The sync example ends on the typed 404.
    assert any("404 session_not_found" in out for out in outputs)


async def test_cli(server: str, tmp_path: Path) -> None:
    transcript = tmp_path / "meeting.txt"
    transcript.write_text("first line of the meeting\n\nsecond line\nthird line\n")
    code, out, err = await run_python(
        "", server, "-m", "clients.cli", "run", str(transcript), "--max-tokens", "3", "--keep", "--temperature", "0"
    )
    assert code == 0, err
    assert len(out.splitlines()) == 3  # one answer per non-empty line
    assert re.search(r"\[3/3 100%\] ttft \d+ ms, 3 tokens .*device \d+, cpu tier \d+, computed \d+", err), err
    session_id = re.search(r"session (sess_\w+) left open", err).group(1)  # type: ignore[union-attr]

    code, out, _ = await run_python("", server, "-m", "clients.cli", "list")
    assert code == 0 and session_id in out
    code, out, _ = await run_python(
        "",
        server,
        "-m",
        "clients.cli",
        "run",
        "--session",
        session_id,
        "--transport",
        "websocket",
        "--quiet",
        "--temperature",
        "0",
        stdin=b"a live line\nanother\n",
    )
    assert code == 0 and len(out.splitlines()) == 2
    code, out, _ = await run_python("", server, "-m", "clients.cli", "show", session_id)
    assert code == 0 and '"num_chunks": 5' in out
    code, out, _ = await run_python("", server, "-m", "clients.cli", "close", session_id)
    assert code == 0 and '"deleted": true' in out
    code, _, err = await run_python("", server, "-m", "clients.cli", "close", session_id)
    assert code == 1 and "session_not_found" in err
