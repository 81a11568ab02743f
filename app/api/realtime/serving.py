"""A Realtime conversation on a streaming session. No FastAPI here.

Items that arrive before a ``response.create`` become one chunk of the session:
the close of the previous reply, the model's chat template rendered for just those
items, and the assistant prefix (``app.sessions.chat.plan_turn``). The session's KV is
reused across turns, so each turn computes only its new items. Where the template
rewrites earlier turns, or the instructions in force change (``session.update``, or a
response's own, which apply to it only), the conversation (kept with the session, in
the store) is rendered again and the context kept up to where the two part. A response streams the chunk's answer as the GA
event sequence; ``response.cancel`` ends it at the next token, and the session
keeps what was generated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openai.types import realtime as rt
from pydantic import BaseModel

from app.api.realtime.protocol import ClientEventError, new_id
from app.api.realtime.responding import RealtimeResponse
from app.api.responses.items import reply_message
from app.errors import APIError
from app.protocol import SamplingOptions, SessionDefaults
from app.sessions.chat import (
    DEFAULT_RETAIN,
    ChatState,
    Messages,
    Truncation,
    continue_within,
    plan_turn,
    unanswered_output,
)
from app.sessions.inputs import Turn, TurnPlan
from app.sessions.run import ChunkRun
from app.sessions.service import SessionService
from app.sessions.session import StreamingSession
from app.tools.parsing import OutputParser, ReplyParsers, ToolCall


@dataclass
class PlannedResponse:
    """A ``response.create`` checked and planned, waiting for the connection's worker."""

    event_id: str | None
    plan: TurnPlan
    options: SamplingOptions
    parser: OutputParser
    messages: Messages  # the items it sends
    instructions_before: str | None  # the instructions the context had before it


def check_max_output_tokens(value: int | str | None, param: str, event_id: str | None) -> None:
    if isinstance(value, int) and value < 1:
        raise ClientEventError("max_output_tokens must be at least 1 (or 'inf').", "invalid_value", param, event_id)


@dataclass
class RealtimeConfig:
    instructions: str | None = None
    max_output_tokens: int | None = None
    # The client's audio settings, echoed back and otherwise unused: clients such as
    # the Agents SDK's Realtime model always send them, text output or not.
    audio: Any = None
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the client declared them
    tool_choice: Any = "auto"
    # OpenAI's Realtime default: a conversation that outgrows the context drops its oldest
    # messages ("disabled": the turn is refused instead).
    truncation: Any = "auto"

    def retain(self) -> float | None:
        """The share of the context a cut leaves (None: no truncation)."""
        if self.truncation == "disabled":
            return None
        return DEFAULT_RETAIN if self.truncation == "auto" else float(self.truncation["retention_ratio"])


@dataclass(frozen=True)
class RealtimeService:
    """What every Realtime connection shares: the sessions, the chat tokenizer, the
    reply parsers."""

    sessions: SessionService
    tokenizer: Any
    parsers: ReplyParsers

    def conversation(self, owner: str, session: StreamingSession, emit: Callable[[BaseModel], Any]) -> Conversation:
        return Conversation(self.sessions, self.tokenizer, self.parsers, owner, session, emit)


@dataclass
class Conversation:
    """One connection's view of its session: config, items, the response running."""

    service: SessionService
    tokenizer: Any
    parsers: ReplyParsers
    owner: str
    session: StreamingSession
    emit: Callable[[BaseModel], Any]  # sends one server event
    config: RealtimeConfig = field(default_factory=RealtimeConfig)
    items: dict[str, Any] = field(default_factory=dict)
    pending: list[dict[str, Any]] = field(default_factory=list)
    responding: bool = False  # a response planned, queued or running
    run: ChunkRun | None = None  # the running response's chunk
    cancel_requested: bool = False  # response.cancel before its chunk started
    # For a session whose context is not a chat's: the instructions last added to it.
    sent_instructions: str | None = None
    _event_ids: int = 0
    _event_prefix: str = ""

    def __post_init__(self) -> None:
        # Attached to a session: its instructions and its answer length are in force.
        if self.session.chat is not None:
            self.config.instructions = self.session.chat.instructions
        if self.session.defaults.max_tokens is not None:
            self.config.max_output_tokens = self.session.defaults.max_tokens

    def event_id(self) -> str:
        """Unique across connections too: a random prefix per connection, then a count."""
        if not self._event_prefix:
            self._event_prefix = new_id("event")
        self._event_ids += 1
        return f"{self._event_prefix}_{self._event_ids}"

    def session_config(self) -> rt.RealtimeSessionCreateRequest:
        config = rt.RealtimeSessionCreateRequest(
            type="realtime",
            model=self.session.model,
            instructions=self.config.instructions,
            output_modalities=["text"],
            max_output_tokens=self.config.max_output_tokens or "inf",
            audio=self.config.audio,
            tools=self.config.tools or None,
            tool_choice=self.config.tool_choice,
            truncation=self.config.truncation,
        )
        # Extension: the session's id, to attach to it again (?session_id=).
        config.id = self.session.id  # type: ignore[attr-defined]
        return config

    # ------------------------------------------------------------------ session
    async def update_session(self, event: rt.SessionUpdateEvent) -> None:
        update = event.session
        if not isinstance(update, rt.RealtimeSessionCreateRequest):
            raise ClientEventError(
                "Only session.type 'realtime' is served here.", "invalid_session_type", "session.type", event.event_id
            )
        if update.output_modalities is not None and update.output_modalities != ["text"]:
            raise ClientEventError(
                "This server answers in text only: output_modalities must be ['text'].",
                "unsupported_modality",
                "session.output_modalities",
                event.event_id,
            )
        tools = self._tools(update.tools, "session.tools", event.event_id)
        limit = self.service.max_chunk_output_tokens
        check_max_output_tokens(update.max_output_tokens, "session.max_output_tokens", event.event_id)
        if isinstance(update.max_output_tokens, int) and update.max_output_tokens > limit:
            raise ClientEventError(
                f"max_output_tokens may be at most {limit}.",
                "max_tokens_too_large",
                "session.max_output_tokens",
                event.event_id,
            )
        if update.instructions is not None:
            self.config.instructions = update.instructions  # they reach the model with the next turn
        if update.max_output_tokens is not None:
            # Kept as the session's default (in the store): a client that attaches again has it.
            explicit = None if update.max_output_tokens == "inf" else update.max_output_tokens
            try:
                await self.service.update_defaults(
                    self.owner, self.session.id, SessionDefaults(max_tokens=explicit or limit)
                )
            except APIError as exc:
                raise ClientEventError(exc.message, exc.code, exc.param, event.event_id) from None
            self.config.max_output_tokens = explicit
        if update.audio is not None:  # output is text (checked above): audio settings change nothing
            self.config.audio = update.audio
        if update.tools is not None:  # they reach the model with the next turn (the head re-rendered)
            self.config.tools = tools
        if update.tool_choice is not None:
            self.config.tool_choice = _plain(update.tool_choice)
        if update.truncation is not None:
            self.config.truncation = _truncation(update.truncation, event.event_id)
        await self.emit(
            rt.SessionUpdatedEvent(type="session.updated", event_id=self.event_id(), session=self.session_config())
        )

    # ------------------------------------------------------------------ items
    async def add_item(self, event: rt.ConversationItemCreateEvent) -> None:
        item = event.item
        message = self._message_of(item, event.event_id)
        if item.id is not None and item.id in self.items:
            raise ClientEventError(
                f"An item with id {item.id!r} exists already.", "item_exists", "item.id", event.event_id
            )
        context = (self.session.chat.messages if self.session.chat is not None else []) + self.pending
        previous = next(reversed(self.items), None)
        at_the_end = previous if previous is not None or context else "root"
        if event.previous_item_id not in (None, at_the_end):  # an insertion, not an append: never moved silently
            raise ClientEventError(
                "Items are added at the end of this conversation (a streaming session is "
                f"append-only): previous_item_id must be {at_the_end!r} or left out.",
                "unsupported_on_session",
                "previous_item_id",
                event.event_id,
            )
        if (call_id := unanswered_output([*context, message], 1)) is not None:
            raise ClientEventError(
                f"Tool call ID {call_id!r} not found in conversation.",
                "tool_call_not_found",
                "item.call_id",
                event.event_id,
            )
        item.id = item.id or new_id("item")
        item.object, item.status = "realtime.item", "completed"  # type: ignore[union-attr]  # (checked above)
        self.items[item.id] = item
        if message.get("tool_calls") and self.pending and self.pending[-1].get("tool_calls"):
            self.pending[-1]["tool_calls"] += message["tool_calls"]  # parallel calls: one assistant turn
        else:
            self.pending.append(message)
        await self.emit(
            rt.ConversationItemAdded(
                type="conversation.item.added", event_id=self.event_id(), item=item, previous_item_id=previous
            )
        )
        await self.emit(
            rt.ConversationItemDone(
                type="conversation.item.done", event_id=self.event_id(), item=item, previous_item_id=previous
            )
        )

    async def retrieve_item(self, event: rt.ConversationItemRetrieveEvent) -> None:
        item = self.items.get(event.item_id)
        if item is None:
            raise ClientEventError(
                f"No item with id {event.item_id!r} in this conversation.", "item_not_found", "item_id", event.event_id
            )
        await self.emit(
            rt.realtime_server_event.ConversationItemRetrieved(
                type="conversation.item.retrieved", event_id=self.event_id(), item=item
            )
        )

    # ------------------------------------------------------------------ responses
    async def create_response(self, event: rt.ResponseCreateEvent) -> PlannedResponse:
        """Check a ``response.create`` and plan its turn, which takes the items added
        since the last; the connection's worker then runs it (``respond``)."""
        if self.responding:
            raise ClientEventError(
                "A response is in progress; cancel it or wait for response.done.",
                "conversation_already_has_active_response",
                None,
                event.event_id,
            )
        overrides = event.response
        max_tokens = self.config.max_output_tokens
        instructions: str | None = None
        if overrides is not None:
            if overrides.output_modalities is not None and overrides.output_modalities != ["text"]:
                raise ClientEventError(
                    "This server answers in text only.",
                    "unsupported_modality",
                    "response.output_modalities",
                    event.event_id,
                )
            if overrides.conversation == "none" or overrides.input is not None:
                raise ClientEventError(
                    "Out-of-band responses (conversation 'none', input) are not supported: "
                    "a response continues the session.",
                    "unsupported_response_field",
                    "response.conversation",
                    event.event_id,
                )
            check_max_output_tokens(overrides.max_output_tokens, "response.max_output_tokens", event.event_id)
            if isinstance(overrides.max_output_tokens, int):
                max_tokens = overrides.max_output_tokens
            instructions = overrides.instructions
        # A response's own tools and tool_choice apply to it alone, as its instructions do.
        tools = (
            self._tools(overrides.tools, "response.tools", event.event_id)
            if overrides is not None and overrides.tools is not None
            else self.config.tools
        )
        tool_choice = (
            _plain(overrides.tool_choice)
            if overrides is not None and overrides.tool_choice is not None
            else self.config.tool_choice
        )
        try:
            parser = self.parsers.reply_parser(
                tools, tool_choice, overrides.parallel_tool_calls if overrides is not None else None
            )
        except (APIError, ValueError) as exc:
            raise ClientEventError(str(exc), "invalid_value", "response.tool_choice", event.event_id) from None
        in_force = (instructions if instructions is not None else self.config.instructions) or None
        options = SamplingOptions(max_tokens=max_tokens or self.service.max_chunk_output_tokens)
        messages = list(self.pending)
        planned = PlannedResponse(
            event.event_id,
            self._turn_plan(messages, in_force, tools, parser, options.max_tokens or 0),
            options,
            parser,
            messages,
            self.sent_instructions,
        )
        # The turn takes the items sent so far (given back if it cannot start).
        self.responding, self.pending, self.sent_instructions = True, [], in_force
        return planned

    async def respond(self, planned: PlannedResponse) -> None:
        """Start the planned turn's chunk and stream its answer (run by the connection's worker)."""
        try:
            try:
                self.run = await self.service.start_chunk(
                    self.owner, self.session.id, planned.plan, planned.options, transport="realtime", wait=True
                )
            except APIError as exc:
                self.pending[:0] = planned.messages
                self.sent_instructions = planned.instructions_before
                raise ClientEventError(exc.message, exc.code, exc.param, planned.event_id) from None
            if self.cancel_requested:
                self.run.stop()
            await RealtimeResponse(
                self.run, planned.parser, self.session.id, self.items, self.emit, self.event_id
            ).stream()
        finally:
            self.responding, self.run, self.cancel_requested = False, None, False

    def _turn_plan(
        self,
        messages: Messages,
        instructions: str | None,
        tools: list[dict[str, Any]],
        parser: OutputParser,
        max_tokens: int,
    ) -> TurnPlan:
        """The turn, planned against the session's context once its lock is held. The
        instructions in force head the conversation: where they differ from those its
        context renders (changed by ``session.update``, or a response's own), the
        conversation is rendered again and the context kept up to where it parts (the
        recompute shows in the usage); otherwise the turn is appended."""
        tokenizer = self.tokenizer
        # A context not built from chat messages: its turns are not known, so
        # instructions can only be added, as a system message, when they change.
        head = (
            [{"role": "system", "content": instructions}]
            if instructions and instructions != self.sent_instructions
            else []
        )

        chat_tools = parser.tools  # checked by _tools already

        def reply(text: str) -> dict[str, Any]:
            return reply_message(parser.final(text))

        retain = self.config.retain()
        truncation = Truncation(self.session.max_tokens, retain) if retain is not None else None

        def plan(context_ids: list[int], conversation: ChatState | None) -> Turn:
            if conversation is None:
                ids, start = plan_turn(tokenizer, None, head + messages, context_ids, chat_tools)
                ids, grammar = parser.answer(ids)
                return Turn(ids, start, None, structured_outputs=grammar, reply=reply)
            wanted = ChatState(instructions, conversation.messages + messages, chat_tools)
            wanted, ids, start, earlier = continue_within(
                truncation, tokenizer, conversation, wanted, context_ids, len(messages), max_tokens
            )
            ids, grammar = parser.answer(ids)
            return Turn(ids, start, wanted, earlier, structured_outputs=grammar, reply=reply)

        return plan

    def _tools(self, tools: Any, param: str, event_id: str | None) -> list[dict[str, Any]]:
        declared = [_plain(tool) for tool in tools or []]
        try:
            self.parsers.declared_tools(declared, param)
        except APIError as exc:
            raise ClientEventError(exc.message, exc.code, exc.param, event_id) from None
        return declared

    def _message_of(self, item: Any, event_id: str | None) -> dict[str, Any]:
        """The chat message an added item is: a user or system message with input_text
        content, a function call (the client's record of one), or a function's output."""
        if isinstance(item, rt.RealtimeConversationItemFunctionCallOutput):
            return {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
        if isinstance(item, rt.RealtimeConversationItemFunctionCall):
            call = ToolCall(item.call_id or new_id("call"), item.name, item.arguments)
            return {"role": "assistant", "content": "", "tool_calls": [call.as_message_call()]}
        if not isinstance(item, rt.RealtimeConversationItemUserMessage | rt.RealtimeConversationItemSystemMessage):
            raise ClientEventError(
                "Only user and system messages with input_text content, function calls and "
                "function call outputs can be added.",
                "unsupported_item",
                "item",
                event_id,
            )
        texts = [part.text for part in item.content if part.type == "input_text" and part.text is not None]
        if len(texts) != len(item.content) or not texts:
            raise ClientEventError(
                "A message's content must be input_text parts, with text.",
                "unsupported_content",
                "item.content",
                event_id,
            )
        return {"role": item.role, "content": "".join(texts)}

    async def cancel_response(self, event: rt.ResponseCancelEvent) -> None:
        if not self.responding:
            raise ClientEventError("No response is in progress.", "response_cancel_not_active", None, event.event_id)
        if self.run is not None:
            self.run.stop()
        else:
            self.cancel_requested = True  # stopped as soon as it starts

    async def close(self) -> None:
        """The connection is gone: a running response is aborted, and its chunk undone
        (the run releases the session whether or not the response began streaming)."""
        if self.run is not None:
            self.run.cancel()


def _plain(value: Any) -> Any:
    """An SDK model as the plain dict the rest of the server reads."""
    return value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value


def _truncation(value: Any, event_id: str | None) -> Any:
    """A session's truncation, checked: "auto", "disabled", or a retention ratio (a share
    of the context that a cut leaves; OpenAI's custom token limits are not taken)."""
    value = _plain(value)
    if value in ("auto", "disabled"):
        return value
    if isinstance(value, dict) and value.get("token_limits"):
        raise ClientEventError(
            "truncation.token_limits is not supported: the limit is the session's context.",
            "unsupported_value",
            "session.truncation.token_limits",
            event_id,
        )
    ratio = value.get("retention_ratio") if isinstance(value, dict) else None
    if not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise ClientEventError(
            "truncation is 'auto', 'disabled' or a retention_ratio in (0, 1].",
            "invalid_value",
            "session.truncation",
            event_id,
        )
    return {"type": "retention_ratio", "retention_ratio": float(ratio)}
