"""Responses items as chat messages, and back: the conversion between OpenAI's item
log and the conversation a session's context renders. Messages with text content,
function calls and their outputs; any other item is refused by name, never dropped.

An assistant's reply is one chat message (its text, and its calls as ``tool_calls``)
but several items (a message item where it wrote text, one ``function_call`` item a
call): ``as_messages`` joins them back as the reply was recorded."""

from __future__ import annotations

import secrets
from typing import Any, get_args

from pydantic import BaseModel

from app.api.responses.protocol import MessageRole, TextPartType
from app.errors import APIError
from app.sessions.chat import Messages
from app.tools.parsing import ParsedOutput, ToolCall

# The item shapes the Conversations API declares (app/api/responses/protocol.py); checked here
# again for Responses input, which arrives through vLLM's own request model.
ROLES: tuple[str, ...] = get_args(MessageRole)
TEXT_PARTS = {**dict.fromkeys(get_args(TextPartType), "text"), "refusal": "refusal"}  # part type: its text field


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def message_item(role: str, text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    """A message item as OpenAI returns it: assistant text is ``output_text``."""
    part: dict[str, Any] = (
        {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        if role == "assistant"
        else {"type": "input_text", "text": text}
    )
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": role, "content": [part]}


def function_call_item(call: ToolCall, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    # The item's id follows from the call's: a stream announces it before the reply is read whole.
    item_id = item_id or "fc_" + call.call_id.removeprefix("call_")
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.call_id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def output_items(parsed: ParsedOutput, message_id: str, status: str = "completed") -> list[dict[str, Any]]:
    """A reply's items: its text as a message (left out where it wrote only calls), then its calls."""
    message = [message_item("assistant", parsed.text, message_id, status)] if parsed.text or not parsed.calls else []
    return message + [function_call_item(call) for call in parsed.calls]


def reply_message(parsed: ParsedOutput) -> dict[str, Any]:
    """A reply as the conversation records it (and the template renders it)."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.text}
    if parsed.calls:
        message["tool_calls"] = [call.as_message_call() for call in parsed.calls]
    return message


def as_messages(items: list[dict[str, Any]]) -> Messages:
    """The chat messages stored items render as: a reply's message and call items join."""
    messages: Messages = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "function_call":
            call = ToolCall(item["call_id"], item["name"], item["arguments"]).as_message_call()
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same reply's text or calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            messages.append(
                {"role": item["role"], "content": "".join(part.get("text", "") for part in item["content"])}
            )
    return messages


def input_items(raw: Any, param: str = "input") -> list[dict[str, Any]]:
    """A request's input as items with ids: a string is one user message; a list holds
    messages (``type`` "message" or left out) with string content or text parts,
    ``function_call`` items (a reply's calls, sent back) and ``function_call_output``
    items (a tool's result). Images, files and the rest are refused (400)."""
    if isinstance(raw, str):
        return [message_item("user", raw)]
    items: list[dict[str, Any]] = []
    for index, entry in enumerate(raw or []):
        item = entry.model_dump(exclude_none=True) if isinstance(entry, BaseModel) else dict(entry)
        where = f"{param}[{index}]"
        if not isinstance(item.get("id"), str | None):  # vLLM's model keeps any id on a message
            raise APIError(400, f"{where}: an item's id is a string.", code="invalid_value", param=f"{where}.id")
        kind = item.get("type", "message")
        if kind == "function_call":
            items.append(_function_call(item, where))
        elif kind == "function_call_output":
            items.append(_function_call_output(item, where))
        elif kind == "message" and item.get("role") in ROLES:
            items.append(message_item(item["role"], _message_text(item.get("content"), where), item.get("id")))
        else:
            raise APIError(
                400,
                f"Only message (roles {', '.join(ROLES)}), function_call and function_call_output "
                f"items are supported here; {where} is a {item.get('type', item.get('role'))!r} item.",
                code="unsupported_input_item",
                param=where,
            )
    return items


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get(TEXT_PARTS[p["type"]]), str)
        for p in content
    ):
        return "".join(p[TEXT_PARTS[p["type"]]] for p in content)  # an assistant's refusal is its text
    raise APIError(
        400,
        f"{where}: a message's content must be a string or text parts.",
        code="unsupported_content",
        param=f"{where}.content",
    )


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise APIError(
                400,
                f"{where}: a function_call item needs a string {name!r}.",
                code="invalid_value",
                param=f"{where}.{name}",
            )
    return function_call_item(ToolCall(item["call_id"], item["name"], item["arguments"]), item.get("id"))


def _function_call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    output = item.get("output")
    if not isinstance(item.get("call_id"), str):
        raise APIError(
            400,
            f"{where}: a function_call_output item needs a string 'call_id'.",
            code="invalid_value",
            param=f"{where}.call_id",
        )
    if not isinstance(output, str):
        output = _message_text(output, where)  # text parts: their text
    return {
        "type": "function_call_output",
        "id": item.get("id") or new_id("fco"),
        "call_id": item["call_id"],
        "output": output,
        "status": "completed",
    }
