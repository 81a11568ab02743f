"""A request body read whole from ASGI, and handed on to the app as if unread."""

from __future__ import annotations

from starlette.types import Message, Receive

from app.errors import APIError


def body_too_large(max_bytes: int) -> APIError:
    return APIError(
        413, f"The request body exceeds {max_bytes} bytes.", code="request_too_large", type="invalid_request_error"
    )


async def read_body(receive: Receive, max_bytes: int | None = None) -> bytes | None:
    """The whole body; None if the client left before sending it all. Over ``max_bytes``:
    413, raised as soon as the bytes read pass it."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body += message.get("body", b"")
        if max_bytes is not None and len(body) > max_bytes:
            raise body_too_large(max_bytes)
        if not message.get("more_body"):
            return bytes(body)


def replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` that gives the body already read once, then the client's next events."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
