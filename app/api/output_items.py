"""One reply's output items as its tokens arrive: the state machine every API that
streams them shares (Responses over SSE and its websocket, Realtime). No wire format
here: each API renders the steps as its own events.

Items are announced as they start, each at the next output index: the assistant
message (at once where the reply can only be text, else with its first text) and each
function call, told from text by the tool parser's stream. The closing steps carry the
reply as read whole (``OutputParser.final``), which is the authority: a message it does
not keep closes incomplete with the text streamed, and a call streamed but absent from
it (its JSON did not parse) closes incomplete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from app.tools.parsing import OutputParser, ParsedOutput, ToolCall

ItemStatus = Literal["completed", "incomplete"]


@dataclass
class StreamedCall:
    """A function call as streamed so far."""

    number: int  # its place among the reply's calls
    output_index: int
    call_id: str
    name: str
    arguments: str = ""


@dataclass(frozen=True)
class MessageOpened:
    output_index: int


@dataclass(frozen=True)
class TextDelta:
    output_index: int
    delta: str


@dataclass(frozen=True)
class CallOpened:
    call: StreamedCall


@dataclass(frozen=True)
class ArgumentsDelta:
    call: StreamedCall
    delta: str


@dataclass(frozen=True)
class MessageClosed:
    output_index: int
    text: str
    status: ItemStatus


@dataclass(frozen=True)
class CallClosed:
    call: StreamedCall
    final: ToolCall | None  # None: not in the reply as read whole
    status: ItemStatus


Step = MessageOpened | TextDelta | CallOpened | ArgumentsDelta | MessageClosed | CallClosed


@dataclass
class OutputItems:
    parser: OutputParser
    next_index: int = 0
    message_index: int | None = None
    text: str = ""  # the message's text as streamed
    calls: dict[int, StreamedCall] = field(default_factory=dict)

    def start(self) -> list[Step]:
        """A reply that can only be text opens its message at once."""
        return [] if self.parser.parses_calls else self._open_message()

    def feed(self, text: str, token_ids: list[int], finished: bool = False) -> list[Step]:
        """The steps of one delta of the reply (``finished``: its last, which flushes the parser)."""
        parsed = self.parser.feed(text, token_ids, finished)
        steps: list[Step] = []
        if parsed.text:
            if self.message_index is None:
                steps += self._open_message()
            assert self.message_index is not None
            self.text += parsed.text
            steps.append(TextDelta(self.message_index, parsed.text))
        for delta in parsed.calls:
            if delta.index not in self.calls:
                if not delta.name:
                    continue  # arguments before a name: vLLM's parsers send none
                steps += self._open_call(delta.index, delta.name)
            if delta.arguments:
                call = self.calls[delta.index]
                call.arguments += delta.arguments
                steps.append(ArgumentsDelta(call, delta.arguments))
        return steps

    def close(self, final: ParsedOutput | None, status: ItemStatus) -> list[Step]:
        """Every item's closing step, in output order of the final reading, then the calls
        it does not have. ``final`` None: the reply was never read whole (its chunk
        failed); what was streamed closes incomplete."""
        steps: list[Step] = []
        has_message = final is not None and (bool(final.text) or not final.calls)
        if has_message and self.message_index is None:
            steps += self._open_message()
        if self.message_index is not None:
            if has_message:
                assert final is not None
                steps.append(MessageClosed(self.message_index, final.text, status))
            else:
                steps.append(MessageClosed(self.message_index, self.text, "incomplete"))
        calls = final.calls if final is not None else []
        for number, call in enumerate(calls):
            if number not in self.calls:
                steps += self._open_call(number, call.name)
            steps.append(CallClosed(self.calls[number], call, status))
        steps += [
            CallClosed(streamed, None, "incomplete") for number, streamed in self.calls.items() if number >= len(calls)
        ]
        return steps

    def _open_message(self) -> list[Step]:
        self.message_index, self.next_index = self.next_index, self.next_index + 1
        return [MessageOpened(self.message_index)]

    def _open_call(self, number: int, name: str) -> list[Step]:
        call = self.calls[number] = StreamedCall(number, self.next_index, self.parser.call_id(number), name)
        self.next_index += 1
        return [CallOpened(call)]
