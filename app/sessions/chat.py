"""Chat turns on a session: the text each turn appends, so that the session's context is
the model's chat template applied to the whole conversation. No FastAPI here.

A turn is rendered as the continuation of a stand-in conversation: what the template
puts after a closed assistant turn is the start of the next one. Before it goes the
close of the session's own last reply, as the template closes an assistant turn (found
by rendering one, not written per model family), less what the reply's last token
already closed: a reply that ended on its own ends on the template's end-of-turn token
(SmolLM2's ``<|im_end|>``), then only the rest (``\\n``) is sent; a reply cut at
``max_tokens`` gets the whole close.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

Messages = list[dict[str, Any]]  # chat messages: an assistant's may hold tool_calls, a tool's a tool_call_id
Tools = list[dict[str, Any]] | None  # function tools in the chat completions shape


@dataclass
class ChatState:
    """A chat session's conversation, as its context renders it: the instructions (a
    system message at its head), the tools the template renders (at the head too, in
    most templates) and every message since, replies included."""

    instructions: str | None = None
    messages: Messages = field(default_factory=list)
    tools: Tools = None
    # The context ends with the template's own close of the last message (a turn sent
    # without the assistant prefix: a warm-up), not with a reply the model sampled.
    closed: bool = False

    def rendered(self) -> Messages:
        head = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return head + self.messages

    def with_messages(self, messages: Messages) -> ChatState:
        """The conversation once a reply (or a turn's messages) is in."""
        return ChatState(self.instructions, self.messages + messages, self.tools)

    def warmed(self) -> ChatState:
        """This conversation as a turn without the assistant prefix leaves it."""
        return ChatState(self.instructions, self.messages, self.tools, closed=True)

    def same_head(self, other: ChatState) -> bool:
        return self.instructions == other.instructions and (self.tools or None) == (other.tools or None)

    def dump(self) -> dict[str, Any]:
        return {
            "instructions": self.instructions,
            "messages": self.messages,
            "tools": self.tools,
            "closed": self.closed,
        }

    @classmethod
    def load(cls, data: dict[str, Any] | None) -> ChatState | None:
        if data is None:
            return None
        return cls(
            data.get("instructions"), list(data.get("messages", [])), data.get("tools"), bool(data.get("closed", False))
        )


def unanswered_output(messages: Messages, new: int) -> str | None:
    """The call id of a tool output among the last ``new`` messages that answers no
    call made before it, if any: OpenAI refuses such an output (Responses and Realtime)."""
    called: set[str] = set()
    for index, message in enumerate(messages):
        if message["role"] == "tool" and index >= len(messages) - new and message.get("tool_call_id") not in called:
            return str(message.get("tool_call_id"))
        called.update(call["id"] for call in message.get("tool_calls", []))
    return None


# The share of the context a cut leaves by default: a quarter stays free for the next
# turns, which append again (a cut that left just enough would re-render every turn).
DEFAULT_RETAIN = 0.75


@dataclass
class Truncation:
    """OpenAI's ``truncation: auto`` on a session: when a turn would not fit the context
    (its rendering plus the answer's ``max_tokens``), the oldest messages are left out
    until the rest fills ``retain`` of it, so that the next turns append again for a
    while (each cut renders the context again from its head: the cost is in the usage)."""

    max_context: int
    retain: float = DEFAULT_RETAIN

    def plan(
        self,
        tokenizer: Any,
        have: ChatState | None,
        wanted: ChatState,
        context_ids: list[int],
        new: int,
        max_tokens: int,
        generation_prompt: bool = True,
    ) -> tuple[ChatState, list[int], int | None, int]:
        """``continue_to``, cutting first where the turn would not fit: the conversation
        as the context will hold it, the ids, where they go, and how many of the ids are
        earlier messages sent again after a cut (not counted as the client's input).
        ``wanted``'s last ``new`` messages are the turn's own: never cut."""
        wanted = _within_cut(have, wanted, new)
        ids, start = continue_to(tokenizer, have, wanted, context_ids, generation_prompt)
        if (len(context_ids) if start is None else start) + len(ids) + max_tokens <= self.max_context:
            return wanted, ids, start, 0
        messages, budget = wanted.messages, self.max_context - max_tokens

        def size(first: int, with_new: bool = True) -> int:
            kept = messages[first:] if with_new else messages[first : len(messages) - new]
            rendered = ChatState(wanted.instructions, kept, wanted.tools).rendered()
            return len(_encode(tokenizer, _apply(tokenizer, rendered, generation_prompt and with_new, wanted.tools)))

        # The fewest messages left out that bring it within ``retain`` of the budget; the
        # context starts at a user message, or at the turn's own messages.
        starts = [
            k for k in range(1, len(messages) - new + 1) if k == len(messages) - new or messages[k]["role"] == "user"
        ]
        if not starts:
            return wanted, ids, start, 0  # nothing to cut: the size check refuses it
        cut = starts[
            min(bisect.bisect_left(starts, True, key=lambda k: size(k) <= self.retain * budget), len(starts) - 1)
        ]
        fitted = ChatState(wanted.instructions, messages[cut:], wanted.tools)
        ids, start = continue_to(tokenizer, have, fitted, context_ids, generation_prompt)
        return fitted, ids, start, 0 if start is None else max(0, size(cut, with_new=False) - start)


def continue_within(
    truncation: Truncation | None,
    tokenizer: Any,
    have: ChatState | None,
    wanted: ChatState,
    context_ids: list[int],
    new: int,
    max_tokens: int,
    generation_prompt: bool = True,
) -> tuple[ChatState, list[int], int | None, int]:
    """``continue_to``, through ``truncation`` where it is on (``Truncation.plan``)."""
    if truncation is None:
        return (wanted, *continue_to(tokenizer, have, wanted, context_ids, generation_prompt), 0)
    return truncation.plan(tokenizer, have, wanted, context_ids, new, max_tokens, generation_prompt)


def _within_cut(have: ChatState | None, wanted: ChatState, new: int) -> ChatState:
    """``wanted`` from where ``have``'s messages begin in it: a conversation's stored items
    are all of its messages, while its context holds what the last cut left."""
    if have is None or not have.messages or not have.same_head(wanted):
        return wanted
    messages, held = wanted.messages, have.messages
    if messages[: len(held)] == held:
        return wanted  # the context holds its beginning: no cut to keep
    # Before the turn's own messages, looked for from there back (where it usually is).
    last = len(messages) - new - len(held)
    cut = next((k for k in range(last, 0, -1) if messages[k : k + len(held)] == held), 0)
    return ChatState(wanted.instructions, messages[cut:], wanted.tools) if cut else wanted


class NotIncrementalError(ValueError):
    """The template renders an earlier turn differently once a later one follows
    (Qwen3 drops a reply's reasoning block once a user message comes after it)."""


# A stand-in conversation whose rendering is the prefix that a later turn continues.
_BEFORE_A_TURN: Messages = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
# An assistant reply no template rewrites, to find where the template's close begins.
_REPLY_MARK = "Zq7xW"


def render_turn(
    tokenizer: Any, messages: Messages, context_ids: list[int], tools: Tools = None, generation_prompt: bool = True
) -> str:
    """The text to append for ``messages`` and the assistant prefix (none without
    ``generation_prompt``: a warm-up), to a session whose context is ``context_ids``
    (empty: the conversation starts here) and ends with a reply the model sampled.
    Raises ValueError where the template cannot continue a conversation (it rewrites
    earlier turns)."""
    if getattr(tokenizer, "chat_template", None) is None:
        turn = _plain(messages, generation_prompt)
        return f"\n{turn}" if context_ids else turn
    if not context_ids:
        return _apply(tokenizer, messages, generation_prompt=generation_prompt, tools=tools)
    before = _apply(tokenizer, _BEFORE_A_TURN, tools=tools)
    full = _apply(tokenizer, _BEFORE_A_TURN + messages, generation_prompt=generation_prompt, tools=tools)
    if not full.startswith(before):
        raise NotIncrementalError("the model's chat template does not render conversations incrementally")
    return reply_close(tokenizer, context_ids[-1]) + full[len(before) :]


def plan_turn(
    tokenizer: Any,
    conversation: Messages | None,
    messages: Messages,
    context_ids: list[int],
    tools: Tools = None,
    generation_prompt: bool = True,
) -> tuple[list[int], int | None]:
    """The token ids of the turn ``messages`` and where they go (None: after the whole
    context), for a session whose context is ``context_ids`` and holds ``conversation``
    (every message so far, replies included; None where it is not known).

    Where the template renders incrementally, the turn is appended (each reply's own
    token ids kept). Where it rewrites an earlier turn, the whole conversation is
    rendered again and the turn starts where that rendering parts from the context:
    the session keeps the common prefix and recomputes only the rest."""
    try:
        return _encode(tokenizer, render_turn(tokenizer, messages, context_ids, tools, generation_prompt)), None
    except NotIncrementalError:
        if conversation is None:
            raise NotIncrementalError(
                "the model's chat template rewrites earlier turns, and this session's earlier turns are not "
                "known as messages (its context was not built from chat messages here)"
            ) from None
        return rerender(tokenizer, conversation + messages, context_ids, tools, generation_prompt)


def continue_to(
    tokenizer: Any, have: ChatState | None, wanted: ChatState, context_ids: list[int], generation_prompt: bool = True
) -> tuple[list[int], int | None]:
    """The token ids that take a context rendering ``have`` (None: not known as a chat)
    to one rendering ``wanted`` (and the assistant prefix, unless this is a warm-up
    without ``generation_prompt``), and where they go (None: after the whole context).
    Appended where ``wanted`` only adds messages to ``have`` under the same
    instructions and tools; otherwise (instructions or tools changed, a message
    deleted, an older point of the conversation continued) rendered again from the
    longest common prefix."""
    if have is not None and have.same_head(wanted) and wanted.messages[: len(have.messages)] == have.messages:
        new = wanted.messages[len(have.messages) :]
        if have.closed and context_ids:
            return _after_closed(tokenizer, have.rendered(), new, context_ids, wanted.tools, generation_prompt)
        return plan_turn(tokenizer, have.rendered(), new, context_ids, wanted.tools, generation_prompt)
    return rerender(tokenizer, wanted.rendered(), context_ids, wanted.tools, generation_prompt)


def _after_closed(
    tokenizer: Any,
    conversation: Messages,
    messages: Messages,
    context_ids: list[int],
    tools: Tools,
    generation_prompt: bool,
) -> tuple[list[int], int | None]:
    """A turn after a warm-up, whose context ends with the template's rendering of
    ``conversation``: what the template adds to it (rendered whole, on a rare path)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return _encode(tokenizer, _plain(messages, generation_prompt)), None
    before = _apply(tokenizer, conversation, tools=tools)
    full = _apply(tokenizer, conversation + messages, generation_prompt=generation_prompt, tools=tools)
    if full.startswith(before) and len(full) > len(before):
        return _encode(tokenizer, full[len(before) :]), None
    return rerender(tokenizer, conversation + messages, context_ids, tools, generation_prompt)


def rerender(
    tokenizer: Any, conversation: Messages, context_ids: list[int], tools: Tools = None, generation_prompt: bool = True
) -> tuple[list[int], int]:
    """The whole ``conversation`` with the assistant prefix (unless not
    ``generation_prompt``), against ``context_ids``: the ids past their longest
    common prefix, and where that prefix ends (at least one id is sent: a chunk is
    never empty)."""
    ids = _encode(tokenizer, _apply(tokenizer, conversation, generation_prompt=generation_prompt, tools=tools))
    keep = 0
    for ours, theirs in zip(context_ids, ids):
        if ours != theirs:
            break
        keep += 1
    keep = min(keep, len(ids) - 1)
    return ids[keep:], keep


def _plain(messages: Messages, generation_prompt: bool) -> str:
    """A model without a chat template: a plain transcript format, one line a message."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if generation_prompt else "")


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def max_messages(tokenizer: Any, max_tokens: int) -> int | None:
    """The most (empty) messages one turn of at most ``max_tokens`` tokens can hold, for
    the published schema; None where a message costs no tokens."""

    def tokens(count: int) -> int:  # as a first turn or a later one, whichever is longer
        messages = [{"role": "user", "content": ""}] * count
        return max(len(_encode(tokenizer, render_turn(tokenizer, messages, context))) for context in ([], [0]))

    per_message = tokens(2) - tokens(1)
    return max((max_tokens - tokens(1)) // per_message + 1, 1) if per_message > 0 else None


def reply_close(tokenizer: Any, last_token_id: int) -> str:
    """What the template puts after an assistant reply's text, less the part of it
    that the reply's last token (``last_token_id``) already is."""
    close = _close_of_a_reply(tokenizer)
    emitted = tokenizer.decode([last_token_id], skip_special_tokens=False)
    return close[len(emitted) :] if emitted and close.startswith(emitted) else close


def _close_of_a_reply(tokenizer: Any) -> str:
    key = (id(tokenizer), tokenizer.chat_template)
    if (close := _CLOSES.get(key)) is None:
        rendered = _apply(tokenizer, [{"role": "user", "content": "."}, {"role": "assistant", "content": _REPLY_MARK}])
        close = _CLOSES[key] = rendered[rendered.rindex(_REPLY_MARK) + len(_REPLY_MARK) :]
    return close


# A close per tokenizer and template (a server has one; tests switch templates).
_CLOSES: dict[tuple[int, str], str] = {}


def _apply(tokenizer: Any, messages: Messages, generation_prompt: bool = False, tools: Tools = None) -> str:
    try:
        # The template named explicitly: vLLM's tokenizer pool renders on copies of the
        # tokenizer, which would not see a template set on it after it was built.
        return str(
            tokenizer.apply_chat_template(
                messages,
                chat_template=tokenizer.chat_template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                tools=tools or None,
            )
        )
    except TemplateError as exc:
        # A template that refuses the conversation (Gemma: no system role; Mistral:
        # roles must alternate): the client's input, not a server fault.
        raise ValueError(f"the model's chat template refused the conversation: {exc}") from exc
