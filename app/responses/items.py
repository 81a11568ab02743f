"""Responses items as chat messages, and back: the conversion between OpenAI's item
log and the conversation a session's context renders. Messages with text content
only, for now: any other item is refused by name, never dropped."""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel

from app.errors import APIError
from app.sessions.chat import Messages

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def message_item(role: str, text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    """A message item as OpenAI returns it: assistant text is ``output_text``."""
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": []} \
        if role == "assistant" else {"type": "input_text", "text": text}
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": role, "content": [part]}


def as_message(item: dict[str, Any]) -> dict[str, str]:
    """The chat message a stored message item renders as."""
    return {"role": item["role"], "content": "".join(part.get("text", "") for part in item["content"])}


def as_messages(items: list[dict[str, Any]]) -> Messages:
    return [as_message(item) for item in items]


def input_items(raw: Any, param: str = "input") -> list[dict[str, Any]]:
    """A request's input as message items with ids: a string is one user message;
    a list holds messages (``type`` "message" or left out) with string content or text
    parts. Function calls, images, files and the rest are refused (400)."""
    if isinstance(raw, str):
        return [message_item("user", raw)]
    items: list[dict[str, Any]] = []
    for index, entry in enumerate(raw or []):
        item = entry.model_dump(exclude_none=True) if isinstance(entry, BaseModel) else dict(entry)
        where = f"{param}[{index}]"
        if item.get("type", "message") != "message" or item.get("role") not in ROLES:
            raise APIError(400, f"Only message items (roles {', '.join(ROLES)}) are supported here; "
                           f"{where} is a {item.get('type', item.get('role'))!r} item.",
                           code="unsupported_input_item", param=where)
        content = item.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                               and isinstance(p.get(TEXT_PARTS[p["type"]]), str) for p in content):
            text = "".join(p[TEXT_PARTS[p["type"]]] for p in content)  # an assistant's refusal is its text
        else:
            raise APIError(400, f"{where}: a message's content must be a string or text parts.",
                           code="unsupported_content", param=f"{where}.content")
        items.append(message_item(item["role"], text, item.get("id")))
    return items
