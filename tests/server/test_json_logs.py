"""JSON logs (``log_format=json``), from one real server process: the records of a
request carry its id (the client's ``X-Request-Id``, echoed back), the session it names
and the replica; records outside any request carry no request id; the engine's own
process logs JSON too. And the middleware alone, without an engine: a request with no
id gets a fresh one, and a record logged outside it has none.
Oracle: the server's own log file, each record read back with ``json.loads``."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.http.log_context import ContextFilter, RequestContextMiddleware
from tests.harness.servers import app_server

pytestmark = pytest.mark.server


def records(log: Path) -> list[dict[str, Any]]:
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            found.append(json.loads(line))  # a line that starts as JSON must be JSON
    return found


def test_json_logs_carry_request_session_and_replica(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with app_server("json-logs", log, {"log_format": "json", "replica_name": "replica-json"}) as server:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            session = http.post("/v1/sessions", json={"defaults": {"max_tokens": 2}}).json()["id"]
            answer = http.post(
                f"/v1/sessions/{session}/chunks",
                json={"input": "hello there"},
                headers={"X-Request-Id": "req-json-logs-1"},
            )
            assert answer.status_code == 200 and answer.headers["x-request-id"] == "req-json-logs-1"
            assert http.get("/health").headers["x-request-id"]  # minted when the client sends none
    logged = records(log)
    assert logged, log.read_text()[-2000:]
    ours = [r for r in logged if r.get("request_id") == "req-json-logs-1"]
    assert ours, "no record of the chunk's request carries its id"
    assert all(r["session_id"] == session and r["replica"] == "replica-json" for r in ours)
    assert {"time", "level", "logger", "message"} <= set(ours[0])
    assert any(r["request_id"] is None for r in logged)  # the start: no request
    engine = [r for r in logged if r["logger"].startswith("vllm.v1.engine.core")]
    assert engine and all(r["replica"] == "replica-json" for r in engine)


def test_middleware_sets_and_clears_the_request_context() -> None:
    seen: list[tuple[str | None, str | None]] = []
    context = ContextFilter()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        record = logging.LogRecord("t", logging.INFO, __file__, 1, "inside", None, None)
        context.filter(record)
        seen.append((record.request_id, record.session_id))  # type: ignore[attr-defined]
        await send({"type": "http.response.start", "status": 200, "headers": []})

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/sessions/sess_abc123/chunks", "query_string": b"", "headers": []}
    asyncio.run(RequestContextMiddleware(app)(scope, None, send))
    request_id, session_id = seen[0]
    assert request_id and len(request_id) == 32 and session_id == "sess_abc123"
    assert (b"x-request-id", request_id.encode()) in sent[0]["headers"]
    outside = logging.LogRecord("t", logging.INFO, __file__, 1, "outside", None, None)
    context.filter(outside)
    assert outside.request_id is None and outside.session_id is None  # type: ignore[attr-defined]
