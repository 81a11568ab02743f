"""DirectRoute: serves a hot route itself only where FastAPI would call the endpoint with
the same body; hands every other request on, body intact.

Oracle: a recording downstream app (what FastAPI would have been given) and a recording
handler, over plain ASGI messages. The server-level twin of this test
(tests/api/sessions/test_sessions_rest.py, ``test_chunk_answers_are_the_same_through_fastapi``)
compares the two paths' answers on a real server.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse, Response

from app.errors import APIError
from app.http.direct_route import DirectRoute


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: str
    max_tokens: int = 1


class Recorder:
    def __init__(self, fail: Exception | None = None) -> None:
        self.app_calls: list[tuple[dict[str, Any], bytes]] = []
        self.handled: list[tuple[str, Body]] = []
        self.fail = fail

    async def app(self, scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        self.app_calls.append((scope, message.get("body", b"")))
        await JSONResponse({"from": "app"})(scope, receive, send)

    async def handler(self, scope: Any, receive: Any, param: str, body: Body) -> Response:
        if self.fail is not None:
            raise self.fail
        self.handled.append((param, body))
        return JSONResponse({"from": "direct", "param": param})


async def call(
    route: DirectRoute,
    body: bytes,
    *,
    path: str = "/v1/sessions/sess_1/chunks",
    method: str = "POST",
    headers: list[tuple[bytes, bytes]] | None = None,
    split: bool = False,
) -> tuple[int, Any]:
    parts = [body[: len(body) // 2], body[len(body) // 2 :]] if split else [body]
    incoming = [{"type": "http.request", "body": part, "more_body": i < len(parts) - 1} for i, part in enumerate(parts)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "headers": headers if headers is not None else [(b"content-type", b"application/json")],
    }
    await route(scope, receive, send)
    if not sent:
        return 0, None
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def route_for(recorder: Recorder) -> DirectRoute:
    return DirectRoute(recorder.app, prefix="/v1/sessions/", suffix="/chunks", model=Body, handler=recorder.handler)


async def test_a_body_that_validates_is_served_directly_with_its_path_parameter() -> None:
    recorder = Recorder()
    status, answer = await call(route_for(recorder), b'{"input": "hi", "max_tokens": 3}', split=True)
    assert (status, answer) == (200, {"from": "direct", "param": "sess_1"})
    assert recorder.handled == [("sess_1", Body(input="hi", max_tokens=3))]
    assert recorder.app_calls == []


@pytest.mark.parametrize(
    "body",
    [
        b'{"input": "hi", "max_tokens": "many"}',  # refused by validation
        b'{"input": "hi", "unknown": 1}',  # an extra field the model forbids
        b'{"input": "hi"',  # not JSON
        b'["input"]',  # JSON, not an object
        b"",  # no body
        b"\xff\xfe",  # not UTF-8
    ],
)
async def test_what_fastapi_would_refuse_goes_to_the_app_with_its_body_intact(body: bytes) -> None:
    recorder = Recorder()
    status, answer = await call(route_for(recorder), body, split=True)
    assert (status, answer) == (200, {"from": "app"})
    assert [sent for _, sent in recorder.app_calls] == [body]
    assert recorder.handled == []


@pytest.mark.parametrize(
    ("path", "method", "headers"),
    [
        ("/v1/sessions/sess_1/chunks", "POST", [(b"origin", b"http://example.com")]),  # CORS: vLLM's middleware
        ("/v1/sessions/sess_1/chunks", "POST", [(b"content-type", b"text/plain")]),  # FastAPI reads no JSON
        ("/v1/sessions/sess_1/chunks", "GET", []),
        ("/v1/sessions//chunks", "POST", []),
        ("/v1/sessions/a/b/chunks", "POST", []),
        ("/v1/sessions/sess_1/chunk", "POST", []),
        ("/v1/sessions/sess_1", "POST", []),
    ],
)
async def test_requests_that_are_not_the_routes_own_go_to_the_app(
    path: str, method: str, headers: list[tuple[bytes, bytes]]
) -> None:
    recorder = Recorder()
    body = b'{"input": "hi"}'
    assert await call(route_for(recorder), body, path=path, method=method, headers=headers) == (200, {"from": "app"})
    assert recorder.handled == []
    assert [sent for _, sent in recorder.app_calls] == [body]


async def test_a_content_type_with_parameters_or_a_json_suffix_is_json() -> None:
    recorder = Recorder()
    for kind in (b"application/json; charset=utf-8", b"application/vnd.api+json", b"APPLICATION/JSON"):
        assert (await call(route_for(recorder), b'{"input": "hi"}', headers=[(b"content-type", kind)]))[1][
            "from"
        ] == "direct"
    # No content type at all: FastAPI reads the body as JSON too.
    assert (await call(route_for(recorder), b'{"input": "hi"}', headers=[]))[1]["from"] == "direct"


async def test_the_handlers_errors_take_the_openai_shape() -> None:
    refusal = APIError(409, "A chunk is in flight.", code="chunk_in_flight")
    assert await call(route_for(Recorder(fail=refusal)), b'{"input": "hi"}') == (409, refusal.body())
    status, answer = await call(route_for(Recorder(fail=RuntimeError("secret detail"))), b'{"input": "hi"}')
    assert status == 500
    assert answer["error"]["code"] == "internal_error"
    assert "secret" not in json.dumps(answer)


async def test_a_client_gone_before_its_body_arrived_gets_nothing() -> None:
    recorder = Recorder()
    route = route_for(recorder)
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/sessions/s/chunks", "root_path": "", "headers": []}
    await route(scope, receive, send)
    assert sent == [] and recorder.handled == [] and recorder.app_calls == []
