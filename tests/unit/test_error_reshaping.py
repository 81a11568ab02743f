"""vLLM's errors in the shapes this server publishes, at the ASGI layer that reshapes
them. Oracle: a scripted ASGI app answers as vLLM's handlers do (the claim is about the
reshaping, not about what makes vLLM fail: tests/http/test_error_shapes.py has those
over real HTTP); the bytes that leave must be OpenAI's shape (or Anthropic's on its
routes), with a content-length that matches."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from app.http.errors import anthropic_error_bytes, openai_error_bytes, reshaping_errors
from app.vllm_routes.usage import UsageProvenanceMiddleware

VLLM_ERROR = {
    "error": {"message": "n must be at least 1, got 0.", "type": "BadRequestError", "param": None, "code": 400}
}


def scripted(status: int, content_type: bytes, *bodies: bytes) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        for index, body in enumerate(bodies):
            await send({"type": "http.response.body", "body": body, "more_body": index < len(bodies) - 1})

    return app


async def run(app: Any, path: str = "/v1/chat/completions") -> tuple[Message, bytes]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(
        {
            "type": "http",
            "method": "POST",
            "path": path,
            "headers": [],
            "app": SimpleNamespace(state=SimpleNamespace()),
        },
        receive,
        send,
    )
    return sent[0], b"".join(message.get("body", b"") for message in sent[1:])


def reshaped(app: Any, reshape: Any) -> Any:
    """``app`` with its answers sent through ``reshaping_errors(send, reshape)``."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        await app(scope, receive, reshaping_errors(send, reshape))

    return wrapped


def content_length(start: Message) -> int:
    return int(dict(start["headers"])[b"content-length"])


async def test_an_error_answered_in_parts_leaves_whole_in_openais_shape() -> None:
    raw = json.dumps(VLLM_ERROR).encode()
    start, body = await run(reshaped(scripted(400, b"application/json", raw[:10], raw[10:]), openai_error_bytes))
    assert json.loads(body) == {
        "error": {
            "message": "n must be at least 1, got 0.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_request",
        }
    }
    assert start["status"] == 400 and content_length(start) == len(body)


async def test_anthropics_shape_on_its_routes_and_others_untouched() -> None:
    ours = json.dumps(
        {
            "error": {
                "message": "top_k: bad",
                "type": "invalid_request_error",
                "param": "top_k",
                "code": "invalid_request",
            }
        }
    ).encode()
    _, body = await run(reshaped(scripted(400, b"application/json", ours), anthropic_error_bytes), "/v1/messages")
    assert json.loads(body) == {"type": "error", "error": {"type": "invalid_request_error", "message": "top_k: bad"}}
    # A success, and an error of another shape, pass as they came.
    for status, payload in ((200, b'{"ok": true}'), (400, b'{"detail": "x"}')):
        assert (await run(reshaped(scripted(status, b"application/json", payload), openai_error_bytes)))[1] == payload


async def test_an_error_inside_a_stream_takes_openais_shape() -> None:
    # vLLM's chat and completion streams send a failure after their 200 as an event
    # (create_streaming_error_response: an InternalServerError with the status as code).
    failure = {"error": {"message": "engine failed", "type": "InternalServerError", "param": None, "code": 500}}
    first = b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n'
    events = first + f"data: {json.dumps(failure)}\n\n".encode() + b"data: [DONE]\n\n"
    app = UsageProvenanceMiddleware(scripted(200, b"text/event-stream", events[:30], events[30:]))
    start, body = await run(app)
    assert start["status"] == 200
    chunks = body.split(b"\n\n")
    assert chunks[0] + b"\n\n" == first and chunks[2] == b"data: [DONE]"
    assert json.loads(chunks[1].removeprefix(b"data: ")) == {
        "error": {"message": "engine failed", "type": "server_error", "param": None, "code": "internal_server_error"}
    }
