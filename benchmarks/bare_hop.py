"""A bare ASGI app on the app's own uvicorn setup, for benchmarks.transport's
``*-bare`` sides: what one loopback HTTP or websocket hop costs on this machine when
the server does nothing (no engine, no FastAPI, no session). It answers every POST
with a fixed JSON body and every websocket message with ``response.done``, in the
shapes the transport benchmark's clients read.

    python -m benchmarks.bare_hop PORT
"""

from __future__ import annotations

import json
import sys
from typing import Any

import uvicorn

from app.http.uvicorn_protocol import CoalescingHttpToolsProtocol

ANSWER = json.dumps(
    {"id": "bare", "object": "session.chunk", "output": {"text": "", "token_ids": [0]}, "finish_reason": "length"}
).encode()


async def lifespan(receive: Any, send: Any) -> None:
    """A lifespan with nothing to start or stop."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


def run(asgi: Any, port: int) -> None:
    """``asgi`` on loopback, on the app's own uvicorn setup (its HTTP protocol, its websockets)."""
    uvicorn.run(
        asgi, host="127.0.0.1", port=port, log_level="warning", ws="websockets-sansio", http=CoalescingHttpToolsProtocol
    )


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
    elif scope["type"] == "http":
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        stream = bool(body) and json.loads(body).get("stream") is True
        headers = [(b"content-type", b"text/event-stream" if stream else b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"data: " + ANSWER + b"\n\ndata: [DONE]\n\n" if stream else ANSWER}
        )
    elif scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": json.dumps({"type": "session.created"})})
        while (message := await receive())["type"] == "websocket.receive":
            kind = json.loads(message["text"])["type"]
            if kind == "session.close":
                break
            reply = "response.done" if kind == "input.append" else "session.updated"
            await send({"type": "websocket.send", "text": json.dumps({"type": reply})})


def main() -> None:
    run(app, int(sys.argv[1]))


if __name__ == "__main__":
    main()
