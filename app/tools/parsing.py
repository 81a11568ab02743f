"""Tool calls (and reasoning) in a model's output, read with vLLM's own parsers (the
``--tool-call-parser`` and ``--reasoning-parser`` names, composed by its
``ParserManager``). No FastAPI here.

One ``OutputParser`` per generation. ``feed`` turns each delta of tokens into what a
stream sends as it arrives (text, reasoning, call deltas); ``final`` extracts once more
from the whole output, and is the authority for the items and messages that are kept:
a stream's deltas only ever preview it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager


@dataclass
class ToolCall:
    """A complete call: ``arguments`` is the JSON text of its arguments object."""

    call_id: str
    name: str
    arguments: str

    def as_message_call(self) -> dict[str, Any]:
        """The call as chat templates read it, in an assistant message's ``tool_calls``."""
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallDelta:
    """Part of a call as it streams: the first delta of a call names it."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    text: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass
class ParsedOutput:
    text: str
    reasoning: str | None
    calls: list[ToolCall]
    malformed: bool = False  # the output opened a call that did not parse: kept as text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools in the chat completions shape (``{"type": "function", "function": {...}}``),
    from it or from the flat shape of the Responses and Realtime APIs."""
    if not tools:
        return None
    shaped = []
    for tool in tools:
        if "function" in tool:
            shaped.append({"type": "function", "function": dict(tool["function"])})
        else:
            function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
            shaped.append({"type": "function", "function": function})
    return shaped


class OutputParser:
    """Reads one generation. ``forced`` is text the prompt already wrote on the model's
    behalf (a call's opening tag, where the call is required): parsed as if generated."""

    def __init__(self, tokenizer: Any, tool_parser: str | None, reasoning_parser: str | None,
                 tools: list[dict[str, Any]] | None, tool_choice: Any = "auto", forced: str = "",
                 prompt_ids: list[int] | None = None) -> None:
        tools = chat_tools(tools)
        self.parses_calls = bool(tools) and tool_parser is not None and tool_choice != "none"
        parser_cls = ParserManager.get_parser(
            tool_parser_name=tool_parser if self.parses_calls else None,
            reasoning_parser_name=reasoning_parser, enable_auto_tools=True)
        # tool_choice "auto" for the parser: a required or named call is forced by the
        # prompt (see forced), and then read as the model's format writes any call.
        self._request = ChatCompletionRequest(
            model="-", messages=[], tools=tools if self.parses_calls else None,
            tool_choice="auto" if self.parses_calls else "none", include_reasoning=True)
        self._parser = parser_cls(tokenizer, list(self._request.tools or []) or None) if parser_cls else None
        self._forced = forced  # the whole output begins with it
        self._unfed = forced  # not yet given to the stream's parser
        # The prompt's ids tell a reasoning parser whether the prompt already closed reasoning.
        self._prompt_ids: list[int] | None = list(prompt_ids or [])

    def feed(self, delta_text: str, delta_ids: list[int], finished: bool = False) -> StreamDelta:
        if self._parser is None:
            return StreamDelta(text=delta_text)
        if self._unfed:
            delta_text, self._unfed = self._unfed + delta_text, ""
        message = self._parser.parse_delta(delta_text, list(delta_ids), self._request, self._prompt_ids,
                                           finished=finished)
        self._prompt_ids = None
        if message is None:
            return StreamDelta()
        calls = [CallDelta(call.index, call.function.name if call.function else None,
                           (call.function.arguments or "") if call.function else "")
                 for call in message.tool_calls or []]
        return StreamDelta(message.content or "", message.reasoning or "", calls)

    def final(self, text: str, token_ids: list[int] | None = None) -> ParsedOutput:
        """The whole output's text, reasoning and calls. A call whose JSON does not parse
        stays in the text (``malformed``), as vLLM's routes leave it."""
        if self._parser is None:
            return ParsedOutput(text, None, [])
        output = self._forced + text
        reasoning, content, calls = self._parser.parse(
            output, self._request, enable_auto_tools=self.parses_calls, model_output_token_ids=token_ids or ())
        parsed = [ToolCall(call.id or new_call_id(), call.name or "", _json_object(call.arguments))
                  for call in calls or [] if call.name]
        malformed = self.parses_calls and not parsed and _opens_a_call(self._parser, output)
        return ParsedOutput(content or "", reasoning, parsed, malformed)


def _json_object(arguments: str | None) -> str:
    """Arguments as compact JSON where they parse (the same call, whoever formats it)."""
    try:
        return json.dumps(json.loads(arguments or "{}"), ensure_ascii=False)
    except ValueError:
        return arguments or ""


def _opens_a_call(parser: Any, output: str) -> bool:
    tool_parser = getattr(parser, "tool_parser", None)
    marker = getattr(tool_parser, "tool_call_start_token", None) or getattr(tool_parser, "bot_token", None)
    return isinstance(marker, str) and bool(marker) and marker in output
