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

from pydantic import BaseModel
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionToolsParam,
)
from vllm.exceptions import VLLMValidationError
from vllm.parser.parser_manager import ParserManager

from app.errors import APIError
from app.tools.opening import forced_opening


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
    """Tools as vLLM's chat completions hands them to the chat template (its
    ``ChatCompletionToolsParam`` dumped), from that shape or from the flat one of the
    Responses and Realtime APIs: the same tools render the same prompt on every route."""
    if not tools:
        return None
    shaped = []
    for tool in tools:
        function = tool["function"] if "function" in tool else {k: v for k, v in tool.items() if k != "type"}
        shaped.append(ChatCompletionToolsParam.model_validate({"type": "function", "function": function}).model_dump())
    return shaped


def function_tools(tools: list[dict[str, Any]], tool_parser: str | None, param: str) -> list[dict[str, Any]] | None:
    """A request's tools (either shape), checked: function tools only, and a tool-call
    parser to read their calls (without one they would be rendered and never read)."""
    for index, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(
                400,
                f"Only function tools are supported; {param}[{index}] is a {tool.get('type')!r} tool.",
                code="unsupported_tool",
                param=f"{param}[{index}]",
            )
    if tools and tool_parser is None:
        raise APIError(
            400,
            "Tools need a tool-call parser, and this server has none for its model (set STREAMSESS_TOOL_CALL_PARSER).",
            code="unsupported_parameter",
            param=param,
        )
    return chat_tools(tools)


# The choices a reply's parser honours (either API's shape names a function too).
TOOL_CHOICE_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ReplyParsers:
    """This server's way of reading replies (its tool-call and reasoning parsers, its
    strict level), on the tokenizer its sessions render with."""

    tokenizer: Any
    tool_parser: str | None
    reasoning_parser: str | None
    strict_level: str = "auto"

    def declared_tools(self, tools: list[dict[str, Any]], param: str) -> list[dict[str, Any]] | None:
        return function_tools(tools, self.tool_parser, param)

    def reply_parser(
        self, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_calls: bool | None = None
    ) -> OutputParser:
        """A reader of one reply; a tool_choice it cannot honour is refused (400)."""
        choice = tool_choice.model_dump(exclude_none=True) if isinstance(tool_choice, BaseModel) else tool_choice
        if not (
            choice is None
            or choice in TOOL_CHOICE_MODES
            or (isinstance(choice, dict) and choice.get("type") == "function")
        ):
            kind = choice.get("type") if isinstance(choice, dict) else choice
            raise APIError(
                400,
                f"tool_choice is none, auto, required or a function here; {kind!r} is not supported.",
                code="unsupported_parameter",
                param="tool_choice",
            )
        if isinstance(choice, dict):
            function = chat_tool_choice(choice).get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if name not in {tool["function"]["name"] for tool in chat_tools(tools) or []}:
                raise APIError(
                    400,
                    f"tool_choice names the function {name!r}, which is not found in tools.",
                    code="invalid_value",
                    param="tool_choice",
                )
        try:
            return OutputParser(
                self.tokenizer,
                self.tool_parser,
                self.reasoning_parser,
                tools,
                tool_choice,
                self.strict_level,
                parallel_calls is not False,
            )
        except VLLMValidationError as invalid:  # vLLM's chat request refused the choice for these tools
            raise APIError(
                400,
                str(invalid.args[0]) if invalid.args else "Invalid tool_choice.",
                code="invalid_value",
                param=invalid.parameter or "tool_choice",
            ) from None


class OutputParser:
    """Reads one generation, for a request's ``tools`` and ``tool_choice`` (either
    API's shape). ``structured_outputs`` is the grammar vLLM's chat completions would
    set for them (a required or named call; under vLLM's strict tool calling, the
    format of every call), for the chunk that generates it."""

    def __init__(
        self,
        tokenizer: Any,
        tool_parser: str | None,
        reasoning_parser: str | None,
        tools: list[dict[str, Any]] | None,
        tool_choice: Any = "auto",
        strict_level: str = "auto",
        parallel_calls: bool = True,
    ) -> None:
        # The tools as the chat template renders them (with tool_choice none too: rendered, not read).
        self.tools = tools = chat_tools(tools)
        self.parses_calls = bool(tools) and tool_parser is not None and tool_choice != "none"
        parser_cls = ParserManager.get_parser(
            tool_parser_name=tool_parser if self.parses_calls else None,
            reasoning_parser_name=reasoning_parser,
            enable_auto_tools=True,
            tool_strict_level=strict_level,
        )
        self._request = ChatCompletionRequest(
            model="-",
            messages=[],
            tools=tools if self.parses_calls else None,
            tool_choice=chat_tool_choice(tool_choice) if self.parses_calls else "none",
            include_reasoning=True,
            parallel_tool_calls=parallel_calls,
        )
        self._parser = parser_cls(tokenizer, list(self._request.tools or []) or None) if parser_cls else None
        # Given with the first delta only: the parser then settles whether the prompt closed
        # reasoning (a turn's prompt never does here) and starts reading calls.
        self._prompt_ids: list[int] | None = []
        self._final: dict[str, ParsedOutput] = {}
        self._grammar: Any = None
        self._call_ids: dict[int, str] = {}
        self.tokenizer = tokenizer
        self._reasons = reasoning_parser is not None
        # What the grammar forces the reply to open with (text, ids), and the grammar for
        # the rest; ``_opened`` is the reply's start once a turn took the opening as input.
        self._rest: Any = None
        self._opening: tuple[str, list[int]] = ("", [])
        self._opened: tuple[str, list[int]] = ("", [])

    def call_id(self, index: int) -> str:
        """The id of the output's ``index``-th call: the same in its stream and in its final reading."""
        if index not in self._call_ids:
            self._call_ids[index] = new_call_id()
        return self._call_ids[index]

    def structured_outputs(self) -> Any:
        """The grammar vLLM's chat completions would set for the reply (None where no
        call is read), built once: a turn's plan asks for it each time it is planned."""
        if self._grammar is None and self._parser is not None and self.parses_calls:
            self._grammar = self._parser.adjust_request(self._request.model_copy(deep=True)).structured_outputs
            # With a reasoning parser, vLLM holds the grammar back until the reasoning ends:
            # nothing is forced at the reply's start, so nothing is prefilled.
            self._rest, opening = forced_opening(self._grammar) if not self._reasons else (self._grammar, "")
            self._opening = (opening, self.tokenizer.encode(opening, add_special_tokens=False) if opening else [])
        return self._grammar

    def answer(self, input_ids: list[int]) -> tuple[list[int], Any]:
        """A generating turn's input ids and its reply's grammar. Where the grammar forces
        how the reply opens (a required or named call), the opening ends the input,
        prefilled instead of decoded, and the grammar takes the reply from there
        (app/tools/opening.py); the reply is read as the opening and what follows it."""
        if self.structured_outputs() is None:
            return input_ids, None
        self._opened = self._opening
        return input_ids + self._opening[1], self._rest

    def feed(self, delta_text: str, delta_ids: list[int], finished: bool = False) -> StreamDelta:
        if self._parser is None:
            return StreamDelta(text=delta_text)
        if self._prompt_ids is not None:  # the reply's first delta: after its opening
            delta_text, delta_ids = self._opened[0] + delta_text, self._opened[1] + list(delta_ids)
        message = self._parser.parse_delta(
            delta_text, list(delta_ids), self._request, self._prompt_ids, finished=finished
        )
        self._prompt_ids = None
        if message is None:
            return StreamDelta()
        calls = [
            CallDelta(
                call.index,
                call.function.name if call.function else None,
                (call.function.arguments or "") if call.function else "",
            )
            for call in message.tool_calls or []
        ]
        return StreamDelta(message.content or "", message.reasoning or "", calls)

    def final(self, text: str, token_ids: list[int] | None = None) -> ParsedOutput:
        """The whole output's text, reasoning and calls (the same object for the same
        text: its call ids are kept). A call whose JSON does not parse stays in the text
        (``malformed``), as vLLM's routes leave it."""
        if self._parser is None:
            return ParsedOutput(text, None, [])
        text, token_ids = self._opened[0] + text, self._opened[1] + list(token_ids or ())
        if (parsed := self._final.get(text)) is None:
            reasoning, content, calls = self._parser.parse(
                text, self._request, enable_auto_tools=self.parses_calls, model_output_token_ids=token_ids or ()
            )
            named = [call for call in calls or [] if call.name]
            arguments = _as_written(text, [call.arguments or "{}" for call in named])
            found = [
                ToolCall(self.call_id(index), call.name or "", arguments[index]) for index, call in enumerate(named)
            ]
            malformed = self.parses_calls and not found and _opens_a_call(self._parser, text)
            parsed = self._final[text] = ParsedOutput(content or "", reasoning, found, malformed)
        return parsed


def chat_tool_choice(tool_choice: Any) -> Any:
    """A tool_choice in the chat completions shape, from it or from the Responses and
    Realtime shape (``{"type": "function", "name": ...}``)."""
    if isinstance(tool_choice, BaseModel):
        tool_choice = tool_choice.model_dump(exclude_none=True)
    if isinstance(tool_choice, dict) and "function" not in tool_choice and "name" in tool_choice:
        return {"type": "function", "function": {"name": tool_choice["name"]}}
    return tool_choice if tool_choice is not None else "auto"


def _as_written(text: str, arguments: list[str]) -> list[str]:
    """Each call's arguments as the model wrote them, where the output holds them in
    order (vLLM's parsers re-serialize them): the streamed argument deltas add up to
    them, and a chat template that renders the call writes the model's own text again,
    so a session's context stays the template's rendering of the conversation.
    Arguments not found as written keep the parser's text."""
    decoder = json.JSONDecoder()
    written, cursor = [], 0
    for serialized in arguments:
        try:
            wanted = json.loads(serialized)
        except ValueError:
            written.append(serialized)
            continue
        found = None
        for start in (i for i in range(cursor, len(text)) if text[i] == "{"):
            try:
                value, end = decoder.raw_decode(text, start)
            except ValueError:
                continue
            if value == wanted:
                found, cursor = text[start:end], end
                break
        written.append(found if found is not None else serialized)
    return written


def _opens_a_call(parser: Any, output: str) -> bool:
    tool_parser = getattr(parser, "tool_parser", None)
    marker = getattr(tool_parser, "tool_call_start_token", None) or getattr(tool_parser, "bot_token", None)
    return isinstance(marker, str) and bool(marker) and marker in output
