"""Every refusal has its status code and the OpenAI error shape, and harms no other session."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.conftest import auth
from tests.helpers import live_request_ids, wait_until_gone

pytestmark = pytest.mark.server


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    return dict(body["error"])


@pytest.fixture
async def http(server: str) -> Any:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=120) as client:
        yield client


async def new_session(http: httpx.AsyncClient) -> str:
    response = await http.post("/v1/sessions", json={"defaults": {"temperature": 0, "ignore_eos": True}})
    assert response.status_code == 201
    return str(response.json()["id"])


async def test_unknown_and_closed_sessions(http: httpx.AsyncClient) -> None:
    assert_openai_error(await http.get("/v1/sessions/sess_nope"), 404, "session_not_found")
    assert_openai_error(await http.post("/v1/sessions/sess_nope/chunks", json={"input": [1]}), 404, "session_not_found")
    session_id = await new_session(http)
    assert (await http.get(f"/v1/sessions/{session_id}/transcript")).status_code == 200
    assert (await http.delete(f"/v1/sessions/{session_id}")).status_code == 200
    # A deleted session is gone, as OpenAI's deleted objects are (schemathesis's
    # use_after_free check found its transcript still served).
    for method, path in [
        ("POST", f"/v1/sessions/{session_id}/chunks"),
        ("GET", f"/v1/sessions/{session_id}"),
        ("GET", f"/v1/sessions/{session_id}/transcript"),
        ("DELETE", f"/v1/sessions/{session_id}"),
    ]:
        body = {"input": [1, 2]} if method == "POST" else None
        assert_openai_error(await http.request(method, path, json=body), 404, "session_not_found")


async def test_malformed_and_invalid_bodies(http: httpx.AsyncClient) -> None:
    session_id = await new_session(http)
    url = f"/v1/sessions/{session_id}/chunks"
    bad_json = await http.post(url, content=b'{"input": [1, 2', headers={"content-type": "application/json"})
    assert_openai_error(bad_json, 400, "invalid_json")
    assert_openai_error(await http.post(url, json={"max_tokens": 3}), 400, "invalid_request")
    assert assert_openai_error(await http.post(url, json={"input": []}), 400)["param"] == "input"
    assert assert_openai_error(await http.post(url, json={"input": [1], "n": 2}), 400)["param"] == "n"
    # A value that fits no form of a union is reported in the form it came closest to.
    missing = assert_openai_error(await http.post(url, json={"input": [{"role": "user"}]}), 400)
    assert missing["param"] == "input.0.content" and "required" in missing["message"], missing
    assert_openai_error(await http.post(url, json={"input": [10**9]}), 400, "invalid_token_id")
    assert_openai_error(await http.post(url, json={"input": [1], "temperature": -1}), 400)
    assert (
        assert_openai_error(await http.post("/v1/sessions", json={"model": "nope"}), 404, "model_not_found")["param"]
        == "model"
    )
    # Nothing was lost: the session still answers.
    ok = await http.post(url, json={"input": [1, 2, 3], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["index"] == 0
    await http.delete(f"/v1/sessions/{session_id}")


async def test_limits(http: httpx.AsyncClient, server_settings: Any) -> None:
    session_id = await new_session(http)
    url = f"/v1/sessions/{session_id}/chunks"
    too_big = [5] * (server_settings.max_chunk_tokens + 1)
    assert_openai_error(await http.post(url, json={"input": too_big}), 400, "chunk_too_large")
    assert_openai_error(
        await http.post(url, json={"input": [1], "max_tokens": server_settings.max_chunk_output_tokens + 1}),
        400,
        "max_tokens_too_large",
    )
    huge_body = b'{"input": "' + b"a" * (server_settings.max_request_body_bytes + 1) + b'"}'
    assert_openai_error(
        await http.post(url, content=huge_body, headers={"content-type": "application/json"}), 413, "request_too_large"
    )

    async def in_pieces(body: bytes) -> AsyncIterator[bytes]:
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]

    # Sent in chunked encoding, with no length to refuse it by: refused once the bytes
    # read pass the limit (it was read whole before), and a small one still answered.
    chunked = await http.post(url, content=in_pieces(huge_body), headers={"content-type": "application/json"})
    assert chunked.request.headers.get("transfer-encoding") == "chunked"
    assert_openai_error(chunked, 413, "request_too_large")
    small = await http.post(
        url, content=in_pieces(b'{"input": [5], "max_tokens": 1}'), headers={"content-type": "application/json"}
    )
    assert small.status_code == 200, small.text
    # Fill the context to near the limit, then one chunk too many.
    for _ in range(2):
        assert (await http.post(url, json={"input": [7] * 2000, "max_tokens": 1})).status_code == 200
    state = (await http.get(f"/v1/sessions/{session_id}")).json()
    assert_openai_error(
        await http.post(url, json={"input": [7] * (state["max_tokens"] - state["num_tokens"]), "max_tokens": 1}),
        400,
        "context_length_exceeded",
    )
    assert (await http.post(url, json={"input": [7, 8], "max_tokens": 1})).status_code == 200
    await http.delete(f"/v1/sessions/{session_id}")


async def test_session_count_limit(http: httpx.AsyncClient, server_settings: Any) -> None:
    # The limit counts every key's sessions, and other tests may hold some under
    # other keys: open until refused, never more than the limit.
    opened: list[str] = []
    try:
        while (created := await http.post("/v1/sessions")).status_code == 201:
            opened.append(created.json()["id"])
            assert len(opened) <= server_settings.max_sessions
        assert_openai_error(created, 429, "too_many_sessions")
    finally:
        for session_id in opened:
            await http.delete(f"/v1/sessions/{session_id}")
    assert (await http.post("/v1/sessions")).status_code == 201


async def test_concurrent_append_gets_409(http: httpx.AsyncClient) -> None:
    session_id = await new_session(http)
    url = f"/v1/sessions/{session_id}/chunks"
    first = asyncio.create_task(http.post(url, json={"input": [3] * 50, "max_tokens": 1000}))
    for _ in range(500):
        if (await http.get(f"/v1/sessions/{session_id}")).json()["status"] == "generating":
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the first chunk never started generating within 5 s")
    second = await http.post(url, json={"input": [4], "max_tokens": 1})
    assert_openai_error(second, 409, "chunk_in_flight")
    assert (await first).status_code == 200
    assert (await http.post(url, json={"input": [4], "max_tokens": 1})).json()["index"] == 1
    await http.delete(f"/v1/sessions/{session_id}")


async def test_missing_or_wrong_key(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, timeout=30) as anonymous:
        assert (await anonymous.get("/health")).status_code == 200
        assert (await anonymous.get("/metrics")).status_code == 200
        assert_openai_error(await anonymous.get("/v1/models"), 401, "invalid_api_key")
        assert_openai_error(await anonymous.post("/v1/sessions"), 401, "invalid_api_key")
        assert_openai_error(
            await anonymous.post("/v1/sessions", headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key"
        )
        assert_openai_error(
            await anonymous.post("/v1/admin/reset_device_cache", headers={"Authorization": "Basic x"}), 401
        )


FIRST, CUT, AGAIN = [3, 1, 4, 1, 5], [9] * 20, [2, 6, 5]


async def uninterrupted(http: httpx.AsyncClient) -> list[list[int]]:
    """The control: the conversation with no disconnect (first chunk, then AGAIN)."""
    control = await new_session(http)
    outputs = []
    for chunk in (FIRST, AGAIN):
        reply = await http.post(f"/v1/sessions/{control}/chunks", json={"input": chunk, "max_tokens": 4})
        outputs.append(reply.json()["output"]["token_ids"])
    await http.delete(f"/v1/sessions/{control}")
    return outputs


async def assert_chunk_undone_and_session_goes_on(
    http: httpx.AsyncClient, engine: Any, session_id: str, expected: list[list[int]]
) -> None:
    """After a disconnect mid-chunk: the engine request is aborted, the session is
    parked at its state before the chunk, and goes on exactly as if the cut chunk
    had never been sent (oracle: the uninterrupted control on the same float32
    engine, whose next chunk resumes from the same transcript)."""
    assert await wait_until_gone(engine, session_id)
    state = (await http.get(f"/v1/sessions/{session_id}")).json()
    assert state["status"] == "parked" and state["num_chunks"] == 1, state
    reply = await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": AGAIN, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    assert reply.json()["index"] == 1 and reply.json()["output"]["token_ids"] == expected[1]
    await http.delete(f"/v1/sessions/{session_id}")


async def test_client_disconnect_mid_chunk_undoes_that_chunk_only(http: httpx.AsyncClient, engine: Any) -> None:
    expected = await uninterrupted(http)
    bystander = await new_session(http)
    victim = await new_session(http)
    url = f"/v1/sessions/{victim}/chunks"
    first = await http.post(url, json={"input": FIRST, "max_tokens": 4})
    assert first.json()["output"]["token_ids"] == expected[0]
    # A long chunk, streamed; the client hangs up after the first delta.
    async with http.stream("POST", url, json={"input": CUT, "max_tokens": 1000, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break
        assert victim in live_request_ids(engine)  # generating when the client hangs up
    await assert_chunk_undone_and_session_goes_on(http, engine, victim, expected)
    # The other session, and the server, go on.
    ok = await http.post(f"/v1/sessions/{bystander}/chunks", json={"input": [1, 2], "max_tokens": 2})
    assert ok.status_code == 200
    assert (await http.get("/health")).status_code == 200
    await http.delete(f"/v1/sessions/{bystander}")


async def test_non_streaming_disconnect_undoes_the_chunk_too(server: str, engine: Any) -> None:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        expected = await uninterrupted(http)
        victim = await new_session(http)
        await http.post(f"/v1/sessions/{victim}/chunks", json={"input": FIRST, "max_tokens": 4})
    async with (
        httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as impatient,
        httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http,
    ):
        # The client hangs up once the chunk is generating (its connection closes).
        request = asyncio.create_task(
            impatient.post(f"/v1/sessions/{victim}/chunks", json={"input": CUT, "max_tokens": 1000})
        )
        deadline = asyncio.get_running_loop().time() + 30
        while (await http.get(f"/v1/sessions/{victim}")).json()["status"] != "generating":
            assert not request.done(), "the chunk ended before the client could hang up"
            assert asyncio.get_running_loop().time() < deadline, "the chunk never started"
            await asyncio.sleep(0.02)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        await assert_chunk_undone_and_session_goes_on(http, engine, victim, expected)


async def test_disconnect_while_sending_the_body_changes_nothing(server: str, engine: Any) -> None:
    """The first phase of a chunk: the client hangs up before its body is complete.
    Nothing reached the session; it answers its next chunk as if nothing happened."""
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        expected = await uninterrupted(http)
        session_id = await new_session(http)
        await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": FIRST, "max_tokens": 4})
        host, port = server.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        body = b'{"input": [9, 9, 9, 9], "max_tokens": 100'
        writer.write(
            f"POST /v1/sessions/{session_id}/chunks HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: {auth()['Authorization']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 100}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        state = (await http.get(f"/v1/sessions/{session_id}")).json()
        assert state["num_chunks"] == 1 and state["status"] == "active", state
        reply = await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": AGAIN, "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["output"]["token_ids"] == expected[1]
        await http.delete(f"/v1/sessions/{session_id}")


async def test_health_answers_503_when_the_engine_is_dead(
    server: str, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        assert (await http.get("/health")).status_code == 200

        async def dead() -> None:
            raise EngineDeadError()

        # Only the health probe sees a dead engine; the real engine keeps running.
        monkeypatch.setattr(engine, "check_health", dead)
        assert (await http.get("/health")).status_code == 503
        monkeypatch.undo()
        assert (await http.get("/health")).status_code == 200


async def test_delete_during_a_chunk_ends_that_chunk(http: httpx.AsyncClient, engine: Any) -> None:
    """Closing a session while it answers must not leave the chunk's request hanging."""
    session_id = await new_session(http)
    chunk = asyncio.create_task(
        http.post(f"/v1/sessions/{session_id}/chunks", json={"input": [5] * 20, "max_tokens": 1000})
    )
    # The delete must land while the chunk generates, or this checks nothing.
    for _ in range(500):
        if (await http.get(f"/v1/sessions/{session_id}")).json()["status"] == "generating":
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the chunk never started generating within 5 s")
    assert (await http.delete(f"/v1/sessions/{session_id}")).status_code == 200
    response = await asyncio.wait_for(chunk, 30)
    assert_openai_error(response, 409, "session_closed")
    assert await wait_until_gone(engine, session_id)
